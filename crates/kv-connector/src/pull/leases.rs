//! [`LeaseTable`]: a producer's issued leases as its HTTP routes see them, so that it lets a
//! consumer read only blocks under a live lease it issued, once.
//!
//! - The scheduler side [`issues`](LeaseTable::issue) a lease in the same call that answers the
//!   request's `kv_transfer_params`, so a consumer can never be faster than the table.
//! - A consumer [`claims`](LeaseTable::claim) it (`POST /v1/kv/claim`) before its READ: the claim
//!   succeeds only for a known remote request id whose lease has not ended or expired, with exactly
//!   the issued block ids, and only once. Replayed or edited params fail here even without a
//!   deployment secret: the remote request id carries 128 random bits.
//! - The proxy may [`release`](LeaseTable::release) an unclaimed lease (`POST /v1/kv/release`,
//!   after its decode call failed) so the blocks free now rather than at expiry; a claimed lease
//!   is the consumer's until its `done` notification or expiry (its READ may be in flight).
//! - The worker side [`takes`](LeaseTable::take_released) the releases each step and
//!   [`ends`](LeaseTable::end) a lease when it frees its blocks (done, release, expiry).
//!
//! Invariant: an entry exists from `issue` until `end`; the worker ends every lease it frees
//! before the engine can reuse the blocks, so a claim never succeeds for freed blocks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tandem_kv_cache::{BlockId, KvStorage};

use super::fault::{corrupt_source, SplitMix, TransportFault};
use crate::error::KvConnectorError;

#[derive(Debug)]
struct Lease {
    /// Per KV cache group (or one shared table), as in `RemotePrefill::remote_block_ids`.
    block_ids: Vec<Vec<BlockId>>,
    /// The prompt's length (the tokens the blocks hold).
    num_tokens: usize,
    deadline: Instant,
    claimed: bool,
    release_requested: bool,
}

#[derive(Default)]
struct Inner {
    leases: HashMap<String, Lease>,
    released: Vec<String>,
    /// Testing only: `corrupt_source`, applied when a claim is granted.
    source_fault: Option<(Arc<KvStorage>, TransportFault, SplitMix)>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("leases", &self.leases.len())
            .field("released", &self.released.len())
            .field("source_fault", &self.source_fault.as_ref().map(|x| x.1))
            .finish()
    }
}

/// What [`LeaseTable::release`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The blocks free at the worker's next step.
    Released,
    /// A consumer claimed the lease; it ends with its `done` or expiry.
    Claimed,
    /// No such lease (already ended, or never issued).
    Unknown,
}

/// Shared by the scheduler side, the worker side and the HTTP routes of one producer.
#[derive(Debug, Clone, Default)]
pub struct LeaseTable(Arc<Mutex<Inner>>);

fn refused(reason: String) -> KvConnectorError {
    KvConnectorError::LeaseRefused(reason)
}

impl LeaseTable {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every critical section below leaves the table consistent, so a poisoned lock is safe.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Arms `corrupt_source` (testing only) over the producer's KV memory.
    pub(crate) fn arm_source_fault(&self, storage: Arc<KvStorage>, fault: TransportFault) {
        self.lock().source_fault = Some((storage, fault, SplitMix::new(fault.seed)));
    }

    /// Records a lease the producer just issued for a prompt of `num_tokens` tokens.
    pub fn issue(
        &self,
        remote_request_id: &str,
        block_ids: &[Vec<BlockId>],
        num_tokens: usize,
        deadline: Instant,
    ) {
        self.lock().leases.insert(
            remote_request_id.to_string(),
            Lease {
                block_ids: block_ids.to_vec(),
                num_tokens,
                deadline,
                claimed: false,
                release_requested: false,
            },
        );
    }

    /// Lets one consumer read the lease's blocks: see the module docs.
    pub fn claim(
        &self,
        remote_request_id: &str,
        block_ids: &[Vec<BlockId>],
    ) -> Result<(), KvConnectorError> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        let Some(lease) = inner.leases.get_mut(remote_request_id) else {
            return Err(refused(format!(
                "no live lease {remote_request_id:?} on this producer (it ended, expired, or \
                 was never issued)"
            )));
        };
        if lease.claimed {
            return Err(refused(format!(
                "lease {remote_request_id:?} was already claimed by a consumer"
            )));
        }
        if lease.release_requested {
            return Err(refused(format!("lease {remote_request_id:?} was released")));
        }
        if lease.deadline <= Instant::now() {
            return Err(refused(format!("lease {remote_request_id:?} expired")));
        }
        if lease.block_ids != block_ids {
            return Err(refused(format!(
                "the claimed blocks are not the blocks of lease {remote_request_id:?}"
            )));
        }
        lease.claimed = true;
        if let Some((storage, fault, rng)) = inner.source_fault.as_mut() {
            if rng.hit(fault.probability) {
                // SAFETY: the lease holds these blocks and its consumer has not read yet (it
                // waits for this answer): nothing reads or writes them during the call.
                let what =
                    unsafe { corrupt_source(storage, &lease.block_ids, lease.num_tokens, rng) };
                if let Some(what) = what {
                    tracing::warn!(
                        remote_request_id,
                        "transport fault injected (corrupt_source, \
                        testing only): {what}, after the checksums, before the READ"
                    );
                }
            }
        }
        Ok(())
    }

    /// Asks the worker to free an unclaimed lease now: see the module docs.
    pub fn release(&self, remote_request_id: &str, block_ids: &[Vec<BlockId>]) -> ReleaseOutcome {
        let mut inner = self.lock();
        let Some(lease) = inner.leases.get_mut(remote_request_id) else {
            return ReleaseOutcome::Unknown;
        };
        if lease.block_ids != block_ids {
            return ReleaseOutcome::Unknown;
        }
        if lease.claimed {
            return ReleaseOutcome::Claimed;
        }
        if !lease.release_requested {
            lease.release_requested = true;
            inner.released.push(remote_request_id.to_string());
        }
        ReleaseOutcome::Released
    }

    /// Remote request ids released since the last call (worker side).
    pub(crate) fn take_released(&self) -> Vec<String> {
        let mut inner = self.lock();
        if inner.released.is_empty() {
            return Vec::new();
        }
        std::mem::take(&mut inner.released)
    }

    /// Forgets a lease whose blocks the worker frees (worker side).
    pub(crate) fn end(&self, remote_request_id: &str) {
        self.lock().leases.remove(remote_request_id);
    }

    /// Leases issued and not yet ended.
    pub fn len(&self) -> usize {
        self.lock().leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_lease_is_claimed_once_with_exactly_its_blocks() {
        let t = LeaseTable::new();
        let later = Instant::now() + Duration::from_secs(30);
        t.issue("r1", &[vec![4, 9, 2]], 40, later);
        for (rid, blocks, needle) in [
            ("r2", &[vec![4u32, 9, 2]][..], "no live lease"),
            ("r1", &[vec![4, 9, 3]][..], "not the blocks"),
            ("r1", &[vec![4, 9]][..], "not the blocks"),
            ("r1", &[vec![9, 4, 2]][..], "not the blocks"),
        ] {
            let e = t.claim(rid, blocks).unwrap_err().to_string();
            assert!(e.contains(needle), "{rid} {blocks:?}: {e}");
        }
        t.claim("r1", &[vec![4, 9, 2]]).unwrap();
        let e = t.claim("r1", &[vec![4, 9, 2]]).unwrap_err().to_string();
        assert!(e.contains("already claimed"), "{e}");
        // A claimed lease is the consumer's: the proxy cannot release it.
        assert_eq!(t.release("r1", &[vec![4, 9, 2]]), ReleaseOutcome::Claimed);
        assert!(t.take_released().is_empty());
        t.end("r1");
        assert!(t.claim("r1", &[vec![4, 9, 2]]).is_err());
        assert!(t.is_empty());
    }

    #[test]
    fn expired_or_released_leases_cannot_be_claimed() {
        let t = LeaseTable::new();
        t.issue(
            "old",
            &[vec![1]],
            10,
            Instant::now() - Duration::from_millis(1),
        );
        assert!(t
            .claim("old", &[vec![1]])
            .unwrap_err()
            .to_string()
            .contains("expired"));
        t.issue(
            "r",
            &[vec![1, 2]],
            20,
            Instant::now() + Duration::from_secs(30),
        );
        assert_eq!(t.release("r", &[vec![1, 3]]), ReleaseOutcome::Unknown);
        assert_eq!(t.release("r", &[vec![1, 2]]), ReleaseOutcome::Released);
        assert_eq!(t.release("r", &[vec![1, 2]]), ReleaseOutcome::Released);
        assert_eq!(t.take_released(), vec!["r".to_string()]);
        assert!(t.take_released().is_empty());
        assert!(t
            .claim("r", &[vec![1, 2]])
            .unwrap_err()
            .to_string()
            .contains("released"));
        assert_eq!(t.release("nope", &[vec![1]]), ReleaseOutcome::Unknown);
    }
}
