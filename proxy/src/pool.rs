//! Upstream instances of one role and the choice among them: least outstanding requests among
//! the healthy ones, ties broken round-robin.
//!
//! Invariants: an instance's `outstanding` counts exactly the live [`Lease`]s on it (incremented
//! when a lease is made, decremented in `Drop`, so also on early returns, cancelled futures and
//! panics). Selection then increment is not atomic: two concurrent picks may see the same counts
//! (approximate least-outstanding, as in vLLM's router). `healthy` is flipped by health checks and
//! by a failed connect; an unhealthy instance is never picked.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use serde::Serialize;

use crate::error::ProxyError;
use crate::telemetry;

/// Which side of a P/D pair an upstream instance plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A `kv_producer`: prefills the prompt and hands out `kv_transfer_params`.
    Prefill,
    /// A `kv_consumer`: pulls the KV and generates the answer.
    Decode,
}

impl Role {
    /// The role's name, as used in metric labels and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One upstream instance.
#[derive(Debug)]
pub(crate) struct Instance {
    role: Role,
    url: String,
    outstanding: AtomicUsize,
    healthy: AtomicBool,
}

impl Instance {
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    pub(crate) fn role(&self) -> Role {
        self.role
    }

    /// Puts the instance in or out of rotation; logs and records a change.
    pub(crate) fn set_healthy(&self, healthy: bool) {
        let was = self.healthy.swap(healthy, Ordering::SeqCst);
        if was != healthy {
            if healthy {
                tracing::info!(role = %self.role, url = %self.url, "upstream instance back in rotation");
            } else {
                tracing::warn!(role = %self.role, url = %self.url, "upstream instance taken out of rotation");
            }
            telemetry::health_set(self.role.as_str(), &self.url, healthy);
        }
    }

    fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
    }

    fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::SeqCst)
    }
}

/// A request in flight on an instance; dropping it ends the count.
#[derive(Debug)]
pub(crate) struct Lease {
    instance: Arc<Instance>,
}

impl Lease {
    fn new(instance: Arc<Instance>) -> Self {
        instance.outstanding.fetch_add(1, Ordering::SeqCst);
        telemetry::outstanding_changed(instance.role.as_str(), &instance.url, 1.0);
        Self { instance }
    }

    pub(crate) fn instance(&self) -> &Arc<Instance> {
        &self.instance
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.instance.outstanding.fetch_sub(1, Ordering::SeqCst);
        telemetry::outstanding_changed(self.instance.role.as_str(), &self.instance.url, -1.0);
    }
}

/// The instances of one role.
#[derive(Debug)]
pub(crate) struct Pool {
    role: Role,
    instances: Vec<Arc<Instance>>,
    cursor: AtomicUsize,
}

impl Pool {
    /// A pool whose instances all start healthy (the first health check runs at once).
    pub(crate) fn new(role: Role, urls: &[String]) -> Self {
        let instances = urls
            .iter()
            .map(|url| {
                telemetry::health_set(role.as_str(), url, true);
                telemetry::outstanding_changed(role.as_str(), url, 0.0);
                Arc::new(Instance {
                    role,
                    url: url.clone(),
                    outstanding: AtomicUsize::new(0),
                    healthy: AtomicBool::new(true),
                })
            })
            .collect();
        Self {
            role,
            instances,
            cursor: AtomicUsize::new(0),
        }
    }

    pub(crate) fn instances(&self) -> &[Arc<Instance>] {
        &self.instances
    }

    /// Whether some instance of the role is in rotation.
    pub(crate) fn has_healthy(&self) -> bool {
        self.instances.iter().any(|i| i.is_healthy())
    }

    /// Leases the healthy instance with the fewest outstanding requests, other than `exclude`;
    /// among equals, the first after a cursor that advances on every call (round-robin).
    pub(crate) fn acquire(&self, exclude: Option<&Arc<Instance>>) -> Result<Lease, ProxyError> {
        let n = self.instances.len();
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<(&Arc<Instance>, usize)> = None;
        for i in 0..n {
            let instance = &self.instances[(start + i) % n];
            if !instance.is_healthy() || exclude.is_some_and(|e| Arc::ptr_eq(e, instance)) {
                continue;
            }
            let load = instance.outstanding();
            if best.is_none_or(|(_, b)| load < b) {
                best = Some((instance, load));
            }
        }
        best.map(|(instance, _)| Lease::new(instance.clone()))
            .ok_or(ProxyError::NoHealthyInstance { role: self.role })
    }

    pub(crate) fn status(&self) -> Vec<InstanceStatus> {
        self.instances
            .iter()
            .map(|i| InstanceStatus {
                url: i.url.clone(),
                healthy: i.is_healthy(),
                outstanding: i.outstanding(),
            })
            .collect()
    }
}

/// What `/health` and [`crate::ProxyState::status`] report about one instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InstanceStatus {
    /// The instance's base URL as configured (trailing `/` removed).
    pub url: String,
    /// Whether it is in rotation.
    pub healthy: bool,
    /// Requests in flight on it through this proxy.
    pub outstanding: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> Pool {
        let urls: Vec<String> = (0..n).map(|i| format!("http://h{i}:1")).collect();
        Pool::new(Role::Decode, &urls)
    }

    fn url(lease: &Lease) -> &str {
        lease.instance().url()
    }

    #[test]
    fn ties_go_round_robin() {
        let pool = pool(3);
        let picks: Vec<String> = (0..6)
            .map(|_| url(&pool.acquire(None).unwrap()).to_owned())
            .collect();
        assert_eq!(picks[0..3], picks[3..6]);
        let mut first = picks[0..3].to_vec();
        first.sort();
        first.dedup();
        assert_eq!(first.len(), 3, "{picks:?}");
    }

    #[test]
    fn least_outstanding_wins_and_leases_release() {
        let pool = pool(2);
        let a = pool.acquire(None).unwrap();
        let busy = url(&a).to_owned();
        for _ in 0..4 {
            let b = pool.acquire(None).unwrap();
            assert_ne!(url(&b), busy);
        }
        drop(a);
        assert!(pool.status().iter().all(|s| s.outstanding == 0));
    }

    #[test]
    fn unhealthy_and_excluded_are_skipped() {
        let pool = pool(2);
        pool.instances()[0].set_healthy(false);
        for _ in 0..3 {
            assert_eq!(url(&pool.acquire(None).unwrap()), "http://h1:1");
        }
        assert!(pool.has_healthy());
        let other = pool.instances()[1].clone();
        assert!(matches!(
            pool.acquire(Some(&other)),
            Err(ProxyError::NoHealthyInstance { role: Role::Decode })
        ));
        pool.instances()[1].set_healthy(false);
        assert!(!pool.has_healthy());
        pool.instances()[0].set_healthy(true);
        assert_eq!(url(&pool.acquire(Some(&other)).unwrap()), "http://h0:1");
    }

    #[test]
    fn lease_is_released_on_panic() {
        let pool = pool(1);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _lease = pool.acquire(None).unwrap();
            panic!("handler panicked");
        }));
        assert!(result.is_err());
        assert_eq!(pool.status()[0].outstanding, 0);
    }
}
