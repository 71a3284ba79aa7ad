//! Upstream instances of one role and the choice among them: least outstanding requests among
//! the healthy ones, ties broken round-robin.
//!
//! Invariants: an instance's `outstanding` counts exactly the live [`Lease`]s on it (incremented
//! when a lease is made, decremented in `Drop`, so also on early returns, cancelled futures and
//! panics). Selection then increment is not atomic: two concurrent picks may see the same counts
//! (approximate least-outstanding, as in vLLM's router). `healthy` is flipped by health checks and
//! by a failed connect; an unhealthy instance is never picked.
//!
//! The instance list is a snapshot that [`Pool::set_resolved`] may replace (DNS discovery of a
//! scaled service's replicas): an instance whose URL stays keeps its `Arc` (and so its counts and
//! health), a removed one lives on only in the leases that still hold it, a new one starts out of
//! rotation until a health check passes. Every instance comes from one configured URL (its
//! `source`); without discovery the instances are exactly the configured URLs.
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

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
    /// The configured URL this instance was found from (equal to `url` without discovery).
    source: String,
    outstanding: AtomicUsize,
    healthy: AtomicBool,
}

impl Instance {
    fn new(role: Role, url: String, source: String, healthy: bool) -> Arc<Self> {
        telemetry::health_set(role.as_str(), &url, healthy);
        telemetry::outstanding_changed(role.as_str(), &url, 0.0);
        Arc::new(Self {
            role,
            url,
            source,
            outstanding: AtomicUsize::new(0),
            healthy: AtomicBool::new(healthy),
        })
    }

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

    pub(crate) fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
    }

    pub(crate) fn outstanding(&self) -> usize {
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
    /// The configured base URLs, in order.
    sources: Vec<String>,
    instances: RwLock<Vec<Arc<Instance>>>,
    cursor: AtomicUsize,
}

impl Pool {
    /// A pool of the configured URLs, all starting healthy (the first health check runs at once).
    pub(crate) fn new(role: Role, urls: &[String]) -> Self {
        let instances = urls
            .iter()
            .map(|url| Instance::new(role, url.clone(), url.clone(), true))
            .collect();
        Self {
            role,
            sources: urls.to_vec(),
            instances: RwLock::new(instances),
            cursor: AtomicUsize::new(0),
        }
    }

    /// The configured base URLs.
    pub(crate) fn sources(&self) -> &[String] {
        &self.sources
    }

    /// A snapshot of the current instances.
    pub(crate) fn instances(&self) -> Vec<Arc<Instance>> {
        self.instances
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces the instances found from `source` by `urls` (in order, duplicates dropped):
    /// instances whose URL is kept stay as they are, new ones start out of rotation, and the
    /// others leave the pool (their health gauge drops to 0). Returns whether the set changed.
    pub(crate) fn set_resolved(&self, source: &str, urls: &[String]) -> bool {
        let mut instances = self.instances.write().unwrap_or_else(|e| e.into_inner());
        let mut next: Vec<Arc<Instance>> = Vec::with_capacity(instances.len());
        let mut changed = false;
        for src in &self.sources {
            if src != source {
                next.extend(instances.iter().filter(|i| i.source == *src).cloned());
                continue;
            }
            for url in urls {
                if next.iter().any(|i| i.url == *url) {
                    continue;
                }
                match instances.iter().find(|i| i.url == *url && i.source == *src) {
                    Some(kept) => next.push(kept.clone()),
                    None => {
                        tracing::info!(role = %self.role, %url, source = %src, "upstream instance discovered");
                        changed = true;
                        next.push(Instance::new(self.role, url.clone(), src.clone(), false));
                    }
                }
            }
        }
        for gone in instances
            .iter()
            .filter(|i| !next.iter().any(|n| Arc::ptr_eq(n, i)))
        {
            tracing::info!(role = %self.role, url = %gone.url, "upstream instance no longer resolved; removed");
            changed = true;
            telemetry::health_set(self.role.as_str(), &gone.url, false);
        }
        *instances = next;
        changed
    }

    /// Whether some instance of the role is in rotation.
    pub(crate) fn has_healthy(&self) -> bool {
        self.instances().iter().any(|i| i.is_healthy())
    }

    /// Leases the healthy instance with the fewest outstanding requests, other than `exclude`;
    /// among equals, the first after a cursor that advances on every call (round-robin).
    pub(crate) fn acquire(&self, exclude: Option<&Arc<Instance>>) -> Result<Lease, ProxyError> {
        let instances = self.instances();
        let n = instances.len();
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<(&Arc<Instance>, usize)> = None;
        for i in 0..n {
            let instance = &instances[(start + i) % n];
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
        self.instances()
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
    fn resolved_instances_replace_their_source_only() {
        let pool = Pool::new(
            Role::Decode,
            &["http://decode:8200".to_owned(), "http://other:1".to_owned()],
        );
        let kept = [
            "http://10.0.0.2:8200".to_owned(),
            "http://10.0.0.3:8200".to_owned(),
        ];
        assert!(pool.set_resolved("http://decode:8200", &kept));
        let urls: Vec<String> = pool.status().into_iter().map(|s| s.url).collect();
        assert_eq!(
            urls,
            [
                "http://10.0.0.2:8200",
                "http://10.0.0.3:8200",
                "http://other:1"
            ]
        );
        // New instances wait for a health check.
        assert!(pool.status()[..2].iter().all(|s| !s.healthy));
        pool.instances()[0].set_healthy(true);
        let lease = pool.acquire(None).unwrap();
        assert_eq!(url(&lease), "http://10.0.0.2:8200");
        // A replica leaves, one stays with its state, the lease outlives the removal.
        assert!(pool.set_resolved("http://decode:8200", &kept[..1]));
        assert!(!pool.set_resolved("http://decode:8200", &kept[..1]));
        let status = pool.status();
        assert_eq!(status.len(), 2);
        assert!(status[0].healthy && status[0].outstanding == 1);
        assert_eq!(pool.instances()[1].source, "http://other:1");
        drop(lease);
        assert_eq!(pool.status()[0].outstanding, 0);
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
