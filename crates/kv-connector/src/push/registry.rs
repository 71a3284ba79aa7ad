//! [`PushRegistry`]: the producer's consumer registrations, shared by its HTTP route (which
//! accepts them) and its push worker (which matches them with finished requests).
//!
//! A transfer id moves through `waiting` (registered, its request not finished here yet) →
//! `taken` (the worker matched it and owns the write) → `ended` (pushed, failed, aborted,
//! released or expired). An ended id is remembered for the hold duration, so a late
//! registration is refused with the reason instead of waiting for nothing.
//!
//! Invariants: at most one registration per transfer id is ever accepted (the first); a waiting
//! registration no producer request claims is dropped after the hold duration (its consumer's
//! load times out); the registry holds at most [`MAX_ENTRIES`] ids, refusing new ones beyond.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::protocol::Registration;
use crate::error::KvConnectorError;
use crate::params::{valid_host, MAX_BLOCK_IDS, MAX_ID_LEN};

/// Most transfer ids tracked at once.
pub const MAX_ENTRIES: usize = 65_536;
/// Longest `valid_ms` accepted: a day.
const MAX_VALID_MS: u64 = 86_400_000;

#[derive(Debug)]
enum Entry {
    Waiting(Box<Registration>, Instant),
    Taken,
    Ended(String, Instant),
}

#[derive(Debug)]
struct Inner {
    entries: HashMap<String, Entry>,
    hold: Duration,
}

/// See the module docs. Cheap to clone.
#[derive(Debug, Clone)]
pub struct PushRegistry(Arc<Mutex<Inner>>);

fn refused(msg: String) -> KvConnectorError {
    KvConnectorError::LeaseRefused(msg)
}

fn invalid(msg: String) -> KvConnectorError {
    KvConnectorError::InvalidTransferParams(msg)
}

/// Checks a registration on its own (not yet against any request).
pub fn validate(reg: &Registration) -> Result<(), KvConnectorError> {
    let id_ok =
        |s: &str| !s.is_empty() && s.len() <= MAX_ID_LEN && !s.chars().any(char::is_control);
    if !id_ok(&reg.transfer_id) {
        return Err(invalid(format!(
            "transfer_id must be 1 to {MAX_ID_LEN} bytes without control characters"
        )));
    }
    if !id_ok(&reg.consumer.engine_id) {
        return Err(invalid(
            "consumer.engine_id is not a valid engine id".into(),
        ));
    }
    if !valid_host(&reg.consumer.host) || reg.consumer.port == 0 {
        return Err(invalid(format!(
            "consumer address {}:{} is not a host and port",
            reg.consumer.host, reg.consumer.port
        )));
    }
    if reg.block_size == 0 || reg.num_tokens == 0 {
        return Err(invalid(
            "block_size and num_tokens must be at least 1".into(),
        ));
    }
    if reg.valid_ms == 0 || reg.valid_ms > MAX_VALID_MS {
        return Err(invalid(format!(
            "valid_ms {} is not in 1..={MAX_VALID_MS}",
            reg.valid_ms
        )));
    }
    if reg.block_ids.is_empty() {
        return Ok(());
    }
    let end = reg.num_tokens.div_ceil(reg.block_size);
    if reg.block_ids.len() > MAX_BLOCK_IDS || reg.first_block + reg.block_ids.len() != end {
        return Err(invalid(format!(
            "{} block ids from block position {} do not end at the prompt's last block ({end} \
             blocks of {} for {} tokens)",
            reg.block_ids.len(),
            reg.first_block,
            reg.block_size,
            reg.num_tokens
        )));
    }
    let mut seen = std::collections::HashSet::with_capacity(reg.block_ids.len());
    if let Some(dup) = reg.block_ids.iter().find(|b| !seen.insert(**b)) {
        return Err(invalid(format!("block {dup} is registered twice")));
    }
    Ok(())
}

impl PushRegistry {
    /// A registry remembering waiting and ended ids for `hold` (the producer's lease duration).
    pub fn new(hold: Duration) -> Self {
        PushRegistry(Arc::new(Mutex::new(Inner {
            entries: HashMap::new(),
            hold,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Accepts a (validated) registration: refused when the id is registered already, has
    /// ended, or the registry is full.
    pub fn register(&self, reg: Registration) -> Result<(), KvConnectorError> {
        let mut inner = self.lock();
        let now = Instant::now();
        inner.prune(now);
        let tid = reg.transfer_id.clone();
        match inner.entries.get(&tid) {
            Some(Entry::Waiting(..)) | Some(Entry::Taken) => {
                return Err(refused(format!(
                    "transfer {tid:?} is already registered by a consumer"
                )))
            }
            Some(Entry::Ended(reason, _)) => {
                return Err(refused(format!(
                    "transfer {tid:?} has ended on this producer: {reason}"
                )))
            }
            None => {}
        }
        if inner.entries.len() >= MAX_ENTRIES {
            return Err(refused(format!(
                "{MAX_ENTRIES} transfers are pending on this producer; try again later"
            )));
        }
        inner
            .entries
            .insert(tid, Entry::Waiting(Box::new(reg), now));
        Ok(())
    }

    /// The worker takes a transfer's registration (once) with its arrival time.
    pub(crate) fn take(&self, transfer_id: &str) -> Option<(Registration, Instant)> {
        let mut inner = self.lock();
        match inner.entries.get(transfer_id) {
            Some(Entry::Waiting(..)) => {}
            _ => return None,
        }
        match inner.entries.insert(transfer_id.to_string(), Entry::Taken) {
            Some(Entry::Waiting(reg, at)) => Some((*reg, at)),
            _ => unreachable!("checked above"),
        }
    }

    /// The transfer ended here; returns its registration if one was waiting (untaken).
    pub(crate) fn end(&self, transfer_id: &str, reason: &str) -> Option<Registration> {
        let mut inner = self.lock();
        let now = Instant::now();
        inner.prune(now);
        let old = inner.entries.insert(
            transfer_id.to_string(),
            Entry::Ended(reason.to_string(), now),
        );
        match old {
            Some(Entry::Waiting(reg, _)) => Some(*reg),
            _ => None,
        }
    }

    /// Ids tracked (waiting, taken or remembered as ended).
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Registrations waiting for their request.
    pub fn num_waiting(&self) -> usize {
        self.lock()
            .entries
            .values()
            .filter(|e| matches!(e, Entry::Waiting(..)))
            .count()
    }
}

impl Inner {
    fn prune(&mut self, now: Instant) {
        let hold = self.hold;
        self.entries.retain(|_, e| match e {
            Entry::Waiting(_, at) | Entry::Ended(_, at) => {
                now.saturating_duration_since(*at) < hold
            }
            Entry::Taken => true,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::super::protocol::ConsumerAddr;
    use super::*;

    pub(crate) fn reg(tid: &str, blocks: Vec<u32>) -> Registration {
        Registration {
            transfer_id: tid.into(),
            consumer: ConsumerAddr {
                engine_id: "d0".into(),
                host: "127.0.0.1".into(),
                port: 8200,
            },
            num_tokens: 40,
            block_size: 16,
            first_block: 3usize.saturating_sub(blocks.len()),
            block_ids: blocks,
            valid_ms: 30_000,
        }
    }

    #[test]
    fn first_registration_wins_and_ended_ids_are_refused_with_their_reason() {
        let r = PushRegistry::new(Duration::from_secs(30));
        r.register(reg("t1", vec![1, 2, 3])).unwrap();
        let e = r.register(reg("t1", vec![4, 5, 6])).unwrap_err();
        assert!(e.to_string().contains("already registered"), "{e}");
        let (got, _) = r.take("t1").unwrap();
        assert_eq!(got.block_ids, vec![1, 2, 3]);
        assert!(r.take("t1").is_none(), "taken once");
        assert!(r.register(reg("t1", vec![7, 8, 9])).is_err());
        assert_eq!(r.end("t1", "pushed"), None);
        let e = r.register(reg("t1", vec![7, 8, 9])).unwrap_err();
        assert!(
            e.to_string().contains("has ended on this producer: pushed"),
            "{e}"
        );
        // A waiting registration is handed back when its transfer ends untaken.
        r.register(reg("t2", vec![1, 2, 3])).unwrap();
        assert_eq!(r.end("t2", "aborted").unwrap().transfer_id, "t2");
    }

    #[test]
    fn waiting_and_ended_ids_are_forgotten_after_the_hold() {
        let r = PushRegistry::new(Duration::from_millis(20));
        r.register(reg("a", vec![1, 2, 3])).unwrap();
        r.end("b", "expired");
        std::thread::sleep(Duration::from_millis(40));
        r.register(reg("c", vec![1, 2, 3])).unwrap();
        assert_eq!(r.len(), 1, "only the new one is left");
        assert!(r.take("a").is_none());
        r.register(reg("b", vec![1, 2, 3])).unwrap();
    }

    #[test]
    fn malformed_registrations_are_invalid() {
        validate(&reg("t", vec![1, 2, 3])).unwrap();
        validate(&reg("t", vec![])).unwrap();
        let mut bad = reg("t", vec![1, 2]);
        bad.first_block = 0;
        assert!(validate(&bad)
            .unwrap_err()
            .to_string()
            .contains("do not end"));
        assert!(validate(&reg("t", vec![1, 1, 2])).is_err(), "duplicates");
        let mut bad = reg("t", vec![1, 2, 3]);
        bad.consumer.host = "a b".into();
        assert!(validate(&bad).is_err());
        let mut bad = reg("", vec![1, 2, 3]);
        assert!(validate(&bad).is_err());
        bad.transfer_id = "t".into();
        bad.valid_ms = 0;
        assert!(validate(&bad).is_err());
    }
}
