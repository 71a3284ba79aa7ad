//! `ProxyState`: what every handler shares — the validated settings, one HTTP client for all
//! upstream calls, the prefill and decode pools, the optional Prometheus handle — and the
//! background health checks of the pools.
//!
//! Invariants: cheap to clone (one `Arc`); without `--resolve-replicas` the pools are fixed at
//! start (instances are only taken out of and put back in rotation); with it, each health round
//! first resolves every configured host name and replaces that URL's instances by one per address
//! (`Pool::set_resolved`). The health-check task ends when its `JoinHandle` is aborted. Every upstream call goes through
//! [`ProxyState::upstream`], the one place that puts the proxy's own key (`--upstream-api-key`)
//! on it; nothing of the client's `Authorization` is ever sent upstream.

use std::sync::Arc;

use axum::http::{header, HeaderValue};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;

use crate::config::{ProxyArgs, Settings};
use crate::discovery;
use crate::error::ProxyError;
use crate::pool::{InstanceStatus, Pool, Role};
use crate::telemetry;

/// Shared state of the proxy's handlers.
#[derive(Clone)]
pub struct ProxyState {
    inner: Arc<Inner>,
}

struct Inner {
    settings: Settings,
    client: reqwest::Client,
    /// `Bearer <upstream key>`, marked sensitive.
    upstream_auth: Option<HeaderValue>,
    prefill: Pool,
    decode: Pool,
    prometheus: Option<PrometheusHandle>,
}

impl std::fmt::Debug for ProxyState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyState")
            .field("settings", &self.inner.settings)
            .field("prefill", &self.inner.prefill)
            .field("decode", &self.inner.decode)
            .finish_non_exhaustive()
    }
}

/// Every upstream instance, as `/health` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProxyStatus {
    /// The prefill instances, in `--prefill` order.
    pub prefill: Vec<InstanceStatus>,
    /// The decode instances, in `--decode` order.
    pub decode: Vec<InstanceStatus>,
}

impl ProxyStatus {
    /// Whether each role has at least one instance in rotation.
    pub fn is_ready(&self) -> bool {
        self.prefill.iter().any(|i| i.healthy) && self.decode.iter().any(|i| i.healthy)
    }
}

/// Most time between health rounds while some instance is out of rotation.
pub const UNHEALTHY_RECHECK: std::time::Duration = std::time::Duration::from_millis(500);

impl ProxyState {
    /// Validates `args` and builds the state. `prometheus` renders `/metrics` (404 without it);
    /// it must be the handle of the globally installed recorder for the proxy's metrics to show.
    pub fn new(args: ProxyArgs, prometheus: Option<PrometheusHandle>) -> Result<Self, ProxyError> {
        let settings = args.validate()?;
        telemetry::describe();
        let client = reqwest::Client::builder()
            .connect_timeout(settings.connect_timeout)
            .tcp_nodelay(true)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| ProxyError::Config(format!("cannot build the HTTP client: {e}")))?;
        let upstream_auth = match &settings.upstream_api_key {
            Some(key) => {
                let mut value = HeaderValue::try_from(format!("Bearer {}", key.expose()))
                    .map_err(|_| ProxyError::Config("invalid upstream API key".to_owned()))?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        let prefill = Pool::new(Role::Prefill, &settings.prefill);
        let decode = Pool::new(Role::Decode, &settings.decode);
        Ok(Self {
            inner: Arc::new(Inner {
                settings,
                client,
                upstream_auth,
                prefill,
                decode,
                prometheus,
            }),
        })
    }

    /// Every upstream instance: in rotation or not, requests in flight.
    pub fn status(&self) -> ProxyStatus {
        ProxyStatus {
            prefill: self.inner.prefill.status(),
            decode: self.inner.decode.status(),
        }
    }

    /// Starts the background health checks: every `health_check_interval_secs`, `GET {url}/health`
    /// on each instance; a 2xx within `health_check_timeout_secs` puts it in rotation, anything
    /// else takes it out. The first round runs at once, and while an instance is out of rotation
    /// rounds come at least every [`UNHEALTHY_RECHECK`], so an instance that comes up (or back)
    /// rejoins quickly. Abort the handle to stop it.
    pub fn spawn_health_checks(&self) -> tokio::task::JoinHandle<()> {
        let state = self.clone();
        tokio::spawn(async move {
            let interval = state.settings().health_check_interval;
            loop {
                state.check_health_once().await;
                let status = state.status();
                let all_up = status
                    .prefill
                    .iter()
                    .chain(&status.decode)
                    .all(|i| i.healthy);
                let wait = if all_up {
                    interval
                } else {
                    interval.min(UNHEALTHY_RECHECK)
                };
                tokio::time::sleep(wait).await;
            }
        })
    }

    /// One round of health checks over every instance, concurrently (after re-resolving the
    /// configured host names, with `--resolve-replicas`).
    pub async fn check_health_once(&self) {
        let timeout = self.settings().health_check_timeout;
        if self.settings().resolve_replicas {
            self.resolve_replicas(timeout).await;
        }
        let instances: Vec<_> = self
            .pool(Role::Prefill)
            .instances()
            .into_iter()
            .chain(self.pool(Role::Decode).instances())
            .collect();
        let checks = instances.iter().map(|instance| async move {
            let url = format!("{}/health", instance.url());
            let check = self.upstream(self.client().get(&url)).timeout(timeout);
            let healthy = match check.send().await {
                Ok(response) => response.status().is_success(),
                Err(e) => {
                    tracing::debug!(%url, error = %e, "health check failed");
                    false
                }
            };
            instance.set_healthy(healthy);
        });
        futures::future::join_all(checks).await;
    }

    /// Resolves every configured URL's host to all its addresses and makes each address an
    /// instance of its role. A lookup that fails or finds nothing leaves that URL's instances as
    /// they were (a service whose replicas are all down may vanish from DNS for a while).
    async fn resolve_replicas(&self, timeout: std::time::Duration) {
        for role in [Role::Prefill, Role::Decode] {
            let pool = self.pool(role);
            for source in pool.sources() {
                match tokio::time::timeout(timeout, discovery::resolve_all(source)).await {
                    Ok(Ok(urls)) if !urls.is_empty() => {
                        pool.set_resolved(source, &urls);
                    }
                    Ok(Ok(_)) => {
                        tracing::debug!(%source, "no address resolved; keeping the instances")
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(%source, error = %e, "lookup failed; keeping the instances")
                    }
                    Err(_) => tracing::debug!(%source, "lookup timed out; keeping the instances"),
                }
            }
        }
    }

    pub(crate) fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    pub(crate) fn client(&self) -> &reqwest::Client {
        &self.inner.client
    }

    /// `request` with the proxy's upstream `Authorization` (if a key is configured).
    pub(crate) fn upstream(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.inner.upstream_auth {
            Some(auth) => request.header(header::AUTHORIZATION, auth.clone()),
            None => request,
        }
    }

    pub(crate) fn pool(&self, role: Role) -> &Pool {
        match role {
            Role::Prefill => &self.inner.prefill,
            Role::Decode => &self.inner.decode,
        }
    }

    pub(crate) fn prometheus(&self) -> Option<&PrometheusHandle> {
        self.inner.prometheus.as_ref()
    }
}
