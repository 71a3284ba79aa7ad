//! The scheduler side of KV checksums: the jobs of each step, the workers' records per job, the
//! producer's payload and the consumer's verdicts.
//!
//! Producer: [`ChecksumTracker::add_send`] in the step whose tokens cross the prompt; the records
//! arrive in later steps; [`ChecksumTracker::finish_send`] when the request finishes gives the
//! encoded payload if every worker reported usable values and the request finished normally.
//! A send whose records are still outstanding when its request finishes is kept (orphaned) until
//! they arrive, so the scheduler can hold the blocks they read; it is then released.
//!
//! Consumer: [`ChecksumTracker::add_load`] when a load starts (the expected payload decoded from
//! `kv_transfer_params`, or, for the connector-owned carrier, taken later from the connector's
//! report by [`ChecksumTracker::receive_checksums`], first copy wins; a fault drawn); the records arrive in the step the load is reported
//! finished; [`ChecksumTracker::verify_load`] compares, counts and logs, and says whether the
//! load is accepted (always, unless fail-closed and not verified).
//!
//! Invariant: a record is merged only into the state of its own (request, generation); records
//! of any other generation are dropped.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde_json::Value;
use tandem_kv_cache::{group_table, BlockId, KvCacheGroup, KvCacheSpec, NULL_BLOCK};
use tandem_kv_checksum::{
    compare, ChecksumRequest, GroupBlocks, Payload, RecordMerger, UnverifiedReason, Verdict,
};
use tandem_kv_connector::base::KV_CHECKSUMS_PARAM;

use super::config::{BlockFault, FaultInjection, FaultKind, KvChecksumConfig, WorkerGrid};
use super::fault::SplitMix;
use crate::metrics as m;
use crate::scheduler_output::{ChecksumJob, ChecksumRecord, ChecksumSide, ChecksumWork};

struct SendState {
    generation: u64,
    merger: RecordMerger,
    /// The request ended before every record arrived.
    orphaned: bool,
}

struct LoadState {
    generation: u64,
    merger: RecordMerger,
    expected: Result<Payload, UnverifiedReason>,
    /// The connector delivers `expected` later ([`ChecksumTracker::receive_checksums`]);
    /// cleared by the first copy.
    awaiting_connector: bool,
    fault: Option<BlockFault>,
}

/// Where a load's expected checksums come from (its connector's carrier).
#[derive(Debug, Clone, Copy)]
pub(crate) enum ExpectedChecksums<'a> {
    /// `kv_transfer_params["kv_checksums"]` of the request.
    Params(Option<&'a Value>),
    /// The connector reports them with the finished load.
    FromConnector,
}

/// What the scheduler does with a load after its verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LoadCheck {
    /// Use the blocks (verified, or fail-open).
    Accept,
    /// Fail-closed and not verified: a KV load failure with this reason.
    Reject {
        reason: String,
        /// Where the load's verified prefix ends, in tokens of the request: a mismatch whose
        /// groups all report a verified prefix (no group unverified). Every block before this
        /// token compared equal (or is the consumer's own); `None` when nothing is known good.
        verified_tokens: Option<usize>,
    },
}

/// The scheduler side of KV checksums. See the module docs.
pub(crate) struct ChecksumTracker {
    fail_closed: bool,
    send_timeout: Duration,
    groups: Vec<(usize, KvCacheSpec)>,
    grid: WorkerGrid,
    faults: Option<(FaultInjection, SplitMix)>,
    next_generation: u64,
    sends: HashMap<u64, SendState>,
    loads: HashMap<u64, LoadState>,
    work: ChecksumWork,
    /// Orphaned sends whose records all arrived: their blocks may be freed.
    released: Vec<u64>,
    /// Unverified reasons already logged at warn level.
    warned: HashSet<&'static str>,
}

impl ChecksumTracker {
    pub(crate) fn new(
        config: &KvChecksumConfig,
        groups: &[KvCacheGroup],
        grid: WorkerGrid,
    ) -> Self {
        ChecksumTracker {
            fail_closed: config.fail_closed,
            send_timeout: config.send_timeout,
            groups: groups.iter().map(|g| (g.group_id, g.spec)).collect(),
            grid,
            faults: config.fault_injection.map(|f| (f, SplitMix::new(f.seed))),
            next_generation: 1,
            sends: HashMap::new(),
            loads: HashMap::new(),
            work: ChecksumWork::default(),
            released: Vec::new(),
            warned: HashSet::new(),
        }
    }

    pub(crate) fn send_timeout(&self) -> Duration {
        self.send_timeout
    }

    /// `tables`: one per group, by group id, or one every group shares.
    fn select(
        &self,
        tables: &[Vec<BlockId>],
        first_token: usize,
        num_tokens: usize,
    ) -> ChecksumRequest {
        let tables: Vec<Vec<Option<usize>>> = tables
            .iter()
            .map(|t| {
                t.iter()
                    .map(|&b| (b != NULL_BLOCK).then_some(b as usize))
                    .collect()
            })
            .collect();
        let empty = Vec::new();
        let groups: Vec<GroupBlocks<'_>> = self
            .groups
            .iter()
            .map(|(group_id, spec)| GroupBlocks {
                group_id: *group_id,
                spec,
                first_position: 0,
                blocks: group_table(&tables, *group_id).unwrap_or(&empty),
            })
            .collect();
        ChecksumRequest::for_load(first_token, num_tokens, &groups)
    }

    fn generation(&mut self) -> u64 {
        let g = self.next_generation;
        self.next_generation += 1;
        g
    }

    fn merger(&self, blocks: ChecksumRequest) -> RecordMerger {
        RecordMerger::new(self.grid.tp_size, self.grid.pp_size, blocks)
    }

    /// This step's work, for the workers.
    pub(crate) fn take_work(&mut self) -> ChecksumWork {
        std::mem::take(&mut self.work)
    }

    /// A producer request's prompt (`num_prompt_tokens` in `table`) is complete after this step.
    /// A previous send of the request (a prefill redone after preemption) is replaced.
    pub(crate) fn add_send(
        &mut self,
        request_id: u64,
        num_prompt_tokens: usize,
        tables: &[Vec<BlockId>],
    ) {
        let blocks = self.select(tables, 0, num_prompt_tokens);
        let generation = self.generation();
        let merger = self.merger(blocks.clone());
        let old = self.sends.insert(
            request_id,
            SendState {
                generation,
                merger,
                orphaned: false,
            },
        );
        if old.is_some_and(|s| !s.merger.is_complete()) {
            // Cannot happen while the scheduler holds in-flight requests' blocks; if it did, the
            // old records are dropped as stale and nothing wrong is sent.
            tracing::warn!(
                request = request_id,
                "a KV checksum send was replaced before its records arrived"
            );
        }
        self.work.sends.push(ChecksumJob {
            request_id,
            generation,
            blocks,
            fault: None,
        });
    }

    /// A load starts: tokens `[first_token, num_tokens)` of `table`, verified against the
    /// checksums its carrier brings.
    pub(crate) fn add_load(
        &mut self,
        request_id: u64,
        expected: ExpectedChecksums<'_>,
        first_token: usize,
        num_tokens: usize,
        tables: &[Vec<BlockId>],
    ) {
        let awaiting_connector = matches!(expected, ExpectedChecksums::FromConnector);
        let expected = match expected {
            ExpectedChecksums::FromConnector => Err(UnverifiedReason::Missing),
            ExpectedChecksums::Params(params) => {
                match params.and_then(|p| p.get(KV_CHECKSUMS_PARAM)) {
                    None | Some(Value::Null) => Err(UnverifiedReason::Missing),
                    Some(Value::String(s)) => Payload::decode(s),
                    Some(_) => Err(UnverifiedReason::Malformed),
                }
            }
        };
        let blocks = self.select(tables, first_token, num_tokens);
        let fault = self.faults.as_mut().and_then(|(f, rng)| {
            (rng.unit() < f.probability).then(|| BlockFault {
                kind: f.kind,
                seed: rng.next_u64(),
                block_position: f.block_position,
                tp_rank: f.tp_rank,
                group: f.group,
            })
        });
        let generation = self.generation();
        let merger = self.merger(blocks.clone());
        self.loads.insert(
            request_id,
            LoadState {
                generation,
                merger,
                expected,
                awaiting_connector,
                fault,
            },
        );
        self.work.recvs.push(ChecksumJob {
            request_id,
            generation,
            blocks,
            fault: fault.filter(|f| f.kind.touches_blocks()),
        });
    }

    /// The connector delivered a load's checksums (connector-owned carrier): the first copy is
    /// kept; later copies, and copies for loads that are not waiting for any, are ignored.
    pub(crate) fn receive_checksums(&mut self, request_id: u64, payload: &str) {
        match self.loads.get_mut(&request_id) {
            Some(state) if state.awaiting_connector => {
                state.awaiting_connector = false;
                state.expected = Payload::decode(payload);
            }
            _ => tracing::debug!(
                request = request_id,
                "KV checksums from the connector for no load waiting for them ignored"
            ),
        }
    }

    /// Merges the workers' records of a step.
    pub(crate) fn add_records(&mut self, records: Vec<ChecksumRecord>) {
        for r in records {
            let id = r.request_id;
            let merger = match r.side {
                ChecksumSide::Send => self
                    .sends
                    .get_mut(&id)
                    .filter(|s| s.generation == r.generation)
                    .map(|s| &mut s.merger),
                ChecksumSide::Recv => self
                    .loads
                    .get_mut(&id)
                    .filter(|s| s.generation == r.generation)
                    .map(|s| &mut s.merger),
            };
            let Some(merger) = merger else {
                tracing::debug!(
                    request = id,
                    generation = r.generation,
                    side = ?r.side,
                    "stale KV checksum record dropped"
                );
                continue;
            };
            if let Err(e) = merger.add(r.record) {
                tracing::warn!(request = id, "KV checksum record dropped: {e}");
            }
            if r.side == ChecksumSide::Send {
                if let Some(s) = self.sends.get(&id) {
                    if s.orphaned && s.merger.is_complete() {
                        self.sends.remove(&id);
                        self.released.push(id);
                    }
                }
            }
        }
    }

    /// Whether a send job of the request still reads its blocks on some worker.
    pub(crate) fn send_in_flight(&self, request_id: u64) -> bool {
        self.sends
            .get(&request_id)
            .is_some_and(|s| !s.merger.is_complete())
    }

    /// Orphaned sends whose records have all arrived since the last call.
    pub(crate) fn take_released(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.released)
    }

    /// The request finished: the encoded payload to send, if it finished normally (`normal`)
    /// and every worker reported usable values. A send still in flight is kept (orphaned) until
    /// its records arrive.
    pub(crate) fn finish_send(
        &mut self,
        request_id: u64,
        normal: bool,
        external_id: &str,
    ) -> Option<String> {
        let state = self.sends.get_mut(&request_id)?;
        if !state.merger.is_complete() {
            state.orphaned = true;
            if normal {
                tracing::warn!(
                    request = %external_id,
                    missing_workers = ?state.merger.missing(),
                    "KV checksums of the prompt did not arrive within {:?}; answering without \
                     them (the consumer's load will be unverified)",
                    self.send_timeout
                );
            } else {
                tracing::warn!(request = %external_id, "request did not finish normally: no KV checksums sent");
            }
            return None;
        }
        let state = self.sends.remove(&request_id)?;
        if !normal {
            tracing::warn!(request = %external_id, "request did not finish normally: no KV checksums sent");
            return None;
        }
        let payload = state
            .merger
            .finish()
            .and_then(|merged| Payload::from_merged(&merged));
        match payload {
            Ok(p) => match p.encode() {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(request = %external_id, "KV checksums not sent: {e}");
                    None
                }
            },
            Err(reason) => {
                tracing::warn!(
                    request = %external_id,
                    reason = reason.as_str(),
                    "KV checksums not sent: the workers' records cannot be used ({reason})"
                );
                None
            }
        }
    }

    /// Forgets a load (it failed, or its request ended). Returns whether there was one.
    pub(crate) fn forget_load(&mut self, request_id: u64) -> bool {
        self.loads.remove(&request_id).is_some()
    }

    /// Compares a finished load (`None`: the load is not checksummed), counts and logs the
    /// verdict, and decides what happens to the blocks.
    pub(crate) fn verify_load(&mut self, request_id: u64, external_id: &str) -> Option<LoadCheck> {
        let state = self.loads.remove(&request_id)?;
        let mut expected = state.expected;
        if let Some(f) = state.fault {
            match f.kind {
                FaultKind::DropChecksums => {
                    tracing::warn!(request = %external_id, "KV fault injection: dropped the expected checksums");
                    expected = Err(UnverifiedReason::Missing);
                }
                FaultKind::MalformChecksums => {
                    tracing::warn!(request = %external_id, "KV fault injection: replaced the expected checksums with garbage");
                    expected = Payload::decode(&format!("fault-injection:{:016x}", f.seed));
                }
                _ => {}
            }
        }
        let verdict = match (expected, state.merger.finish()) {
            (Err(r), _) | (Ok(_), Err(r)) => Verdict::unverified(r),
            (Ok(p), Ok(merged)) => compare(&p, &merged),
        };
        metrics::counter!(m::KV_CHECKSUM_LOADS_TOTAL, "verdict" => verdict.label()).increment(1);
        let what = describe(&verdict);
        match &verdict {
            Verdict::Verified { groups } => {
                tracing::debug!(request = %external_id, ?groups, "KV load verified");
            }
            Verdict::Mismatch { .. } => {
                metrics::counter!(m::KV_CHECKSUM_MISMATCHED_BLOCKS_TOTAL)
                    .increment(verdict.mismatched_blocks() as u64);
                tracing::error!(
                    request = %external_id,
                    fail_closed = self.fail_closed,
                    "KV checksum mismatch: {what}"
                );
            }
            Verdict::Unverified { reason, .. } => {
                metrics::counter!(m::KV_CHECKSUM_UNVERIFIED_TOTAL, "reason" => reason.as_str())
                    .increment(1);
                if self.warned.insert(reason.as_str()) {
                    tracing::warn!(
                        reason = reason.as_str(),
                        fail_closed = self.fail_closed,
                        "KV load unverified: {reason} (logged once per reason; details at debug)"
                    );
                }
                tracing::debug!(request = %external_id, "KV load unverified: {what}");
            }
        }
        Some(if verdict.is_verified() || !self.fail_closed {
            LoadCheck::Accept
        } else {
            LoadCheck::Reject {
                reason: format!("KV failed checksum verification: {what}"),
                verified_tokens: self.verified_tokens(&verdict),
            }
        })
    }

    /// The earliest end of a verified prefix over the mismatched groups, in tokens; `None` unless
    /// the verdict is a mismatch with no unverified group (a group that could not be compared
    /// vouches for none of its blocks).
    fn verified_tokens(&self, verdict: &Verdict) -> Option<usize> {
        let Verdict::Mismatch { groups, unverified } = verdict else {
            return None;
        };
        if !unverified.is_empty() {
            return None;
        }
        groups
            .iter()
            .map(|g| {
                let (_, spec) = self.groups.iter().find(|(id, _)| *id == g.group_id)?;
                g.verified_prefix_end.checked_mul(spec.block_size())
            })
            .collect::<Option<Vec<usize>>>()?
            .into_iter()
            .min()
    }

    /// Requests with checksum state.
    #[cfg(test)]
    pub(crate) fn num_tracked(&self) -> usize {
        self.sends.len() + self.loads.len()
    }
}

/// A verdict in words: groups and block positions.
fn describe(v: &Verdict) -> String {
    let unverified = |groups: &[(usize, UnverifiedReason)]| {
        groups
            .iter()
            .map(|(g, r)| format!("group {g} unverified ({r})"))
            .collect::<Vec<_>>()
    };
    match v {
        Verdict::Verified { groups } => format!("verified groups {groups:?}"),
        Verdict::Mismatch {
            groups,
            unverified: u,
        } => {
            let mut parts: Vec<String> = groups
                .iter()
                .map(|g| {
                    let mut s = format!(
                        "group {} mismatch at block positions {:?}",
                        g.group_id, g.block_positions
                    );
                    if g.replica_checks.iter().any(|&c| c != 0) {
                        s.push_str(&format!(" (replica checks {:?})", g.replica_checks));
                    }
                    s
                })
                .collect();
            parts.extend(unverified(u));
            parts.join("; ")
        }
        Verdict::Unverified { reason, groups } => {
            let mut s = format!("unverified ({reason})");
            let g = unverified(groups);
            if !g.is_empty() {
                s.push_str(&format!(": {}", g.join("; ")));
            }
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_cache::{CacheDtype, KvCacheConfig, KvStorage};
    use tandem_kv_checksum::{CpuBackend, Role, WorkerChecksums};

    fn instance() -> (KvStorage, WorkerChecksums, Vec<KvCacheGroup>) {
        let groups = vec![KvCacheGroup {
            group_id: 0,
            spec: KvCacheSpec::FullAttention {
                block_size: 4,
                num_kv_heads: 2,
                head_dim: 8,
                dtype: CacheDtype::F16,
            },
            layer_names: vec!["layers.0".into(), "layers.1".into()],
        }];
        let config = KvCacheConfig {
            num_blocks: 8,
            groups: groups.clone(),
        };
        let storage = KvStorage::new(&config).unwrap();
        for slot in 0..32 {
            let k: Vec<f32> = (0..16).map(|i| (slot * 3 + i) as f32).collect();
            for l in 0..2 {
                storage.write_slots(l, &[slot], &k, &k).unwrap();
            }
        }
        let setup = WorkerChecksums::single(&storage, &config);
        (storage, setup, groups)
    }

    fn tracker(groups: &[KvCacheGroup], grid: WorkerGrid) -> ChecksumTracker {
        let config = KvChecksumConfig {
            enabled: true,
            ..Default::default()
        };
        ChecksumTracker::new(&config, groups, grid)
    }

    fn record(
        storage: &KvStorage,
        setup: &WorkerChecksums,
        job: &ChecksumJob,
        side: ChecksumSide,
    ) -> ChecksumRecord {
        let role = match side {
            ChecksumSide::Send => Role::Producer,
            ChecksumSide::Recv => Role::Consumer,
        };
        ChecksumRecord {
            request_id: job.request_id,
            generation: job.generation,
            side,
            record: setup.checksum(&CpuBackend::new(storage), role, &job.blocks),
        }
    }

    #[test]
    fn records_of_an_older_generation_never_complete_a_send() {
        let (storage, setup, groups) = instance();
        let mut t = tracker(&groups, WorkerGrid::default());
        t.add_send(1, 7, &[vec![0, 1]]);
        let first = t.take_work().sends.remove(0);
        // preempted and prefilled again, into other blocks
        t.add_send(1, 7, &[vec![4, 5]]);
        let second = t.take_work().sends.remove(0);
        assert_ne!(first.generation, second.generation);
        t.add_records(vec![record(&storage, &setup, &first, ChecksumSide::Send)]);
        assert!(t.send_in_flight(1), "a stale record completed the send");
        t.add_records(vec![record(&storage, &setup, &second, ChecksumSide::Send)]);
        assert!(!t.send_in_flight(1));
        let sent = Payload::decode(&t.finish_send(1, true, "r").unwrap()).unwrap();
        // the values are those of blocks 4 and 5, not 0 and 1
        let mut merger = RecordMerger::new(1, 1, second.blocks.clone());
        merger
            .add(record(&storage, &setup, &second, ChecksumSide::Send).record)
            .unwrap();
        let want = Payload::from_merged(&merger.finish().unwrap()).unwrap();
        assert_eq!(sent, want);
        assert_eq!(t.num_tracked(), 0);
    }

    #[test]
    fn a_send_waits_for_every_worker_and_an_orphan_is_released_when_they_report() {
        let (storage, setup, groups) = instance();
        let mut t = tracker(
            &groups,
            WorkerGrid {
                tp_size: 2,
                pp_size: 1,
            },
        );
        t.add_send(3, 8, &[vec![2, 3]]);
        let job = t.take_work().sends.remove(0);
        let r0 = record(&storage, &setup, &job, ChecksumSide::Send);
        t.add_records(vec![r0.clone()]);
        assert!(t.send_in_flight(3), "one of two workers reported");
        // the request finishes (timed out): nothing sent, the state kept for the hold
        assert_eq!(t.finish_send(3, true, "r"), None);
        assert!(t.send_in_flight(3));
        assert!(t.take_released().is_empty());
        let mut r1 = r0;
        r1.record.worker.tp_rank = 1;
        t.add_records(vec![r1]);
        assert_eq!(t.take_released(), vec![3]);
        assert!(!t.send_in_flight(3));
        assert_eq!(t.num_tracked(), 0);
    }

    #[test]
    fn a_load_is_compared_with_what_the_producer_sent() {
        let (storage, setup, groups) = instance();
        // producer: blocks 0, 1 hold tokens [0, 7)
        let mut p = tracker(&groups, WorkerGrid::default());
        p.add_send(1, 7, &[vec![0, 1]]);
        let job = p.take_work().sends.remove(0);
        p.add_records(vec![record(&storage, &setup, &job, ChecksumSide::Send)]);
        let payload = p.finish_send(1, true, "p").unwrap();
        let params = serde_json::json!({ KV_CHECKSUMS_PARAM: payload });
        // consumer: the same KV, loaded into the same blocks, verifies
        let mut c = tracker(&groups, WorkerGrid::default());
        c.add_load(
            9,
            ExpectedChecksums::Params(Some(&params)),
            0,
            7,
            &[vec![0, 1]],
        );
        let job = c.take_work().recvs.remove(0);
        c.add_records(vec![record(&storage, &setup, &job, ChecksumSide::Recv)]);
        assert_eq!(c.verify_load(9, "c"), Some(LoadCheck::Accept));
        // other blocks (other KV) mismatch; fail-open accepts, fail-closed rejects
        for fail_closed in [false, true] {
            let config = KvChecksumConfig {
                enabled: true,
                fail_closed,
                ..Default::default()
            };
            let mut c = ChecksumTracker::new(&config, &groups, WorkerGrid::default());
            c.add_load(
                9,
                ExpectedChecksums::Params(Some(&params)),
                0,
                7,
                &[vec![5, 6]],
            );
            let job = c.take_work().recvs.remove(0);
            c.add_records(vec![record(&storage, &setup, &job, ChecksumSide::Recv)]);
            match c.verify_load(9, "c").unwrap() {
                LoadCheck::Accept => assert!(!fail_closed),
                LoadCheck::Reject {
                    reason,
                    verified_tokens,
                } => {
                    assert!(fail_closed);
                    assert!(
                        reason.contains("mismatch at block positions [0, 1]"),
                        "{reason}"
                    );
                    assert_eq!(verified_tokens, Some(0), "block 0 differs: nothing kept");
                }
            }
        }
        // a mismatch in the second block only: the first block's tokens are kept
        let config = KvChecksumConfig {
            enabled: true,
            fail_closed: true,
            ..Default::default()
        };
        let mut c = ChecksumTracker::new(&config, &groups, WorkerGrid::default());
        c.add_load(
            9,
            ExpectedChecksums::Params(Some(&params)),
            0,
            7,
            &[vec![0, 6]],
        );
        let job = c.take_work().recvs.remove(0);
        c.add_records(vec![record(&storage, &setup, &job, ChecksumSide::Recv)]);
        match c.verify_load(9, "c") {
            Some(LoadCheck::Reject {
                reason,
                verified_tokens,
            }) => {
                assert!(
                    reason.contains("mismatch at block positions [1]"),
                    "{reason}"
                );
                assert_eq!(verified_tokens, Some(4));
            }
            other => panic!("expected a rejected load, got {other:?}"),
        }
        // no record at all: unverified, never accepted under fail-closed
        let config = KvChecksumConfig {
            enabled: true,
            fail_closed: true,
            ..Default::default()
        };
        let mut c = ChecksumTracker::new(&config, &groups, WorkerGrid::default());
        c.add_load(
            9,
            ExpectedChecksums::Params(Some(&params)),
            0,
            7,
            &[vec![0, 1]],
        );
        assert!(matches!(
            c.verify_load(9, "c"),
            Some(LoadCheck::Reject {
                verified_tokens: None,
                ..
            })
        ));
        assert_eq!(c.verify_load(9, "c"), None, "verified once");
    }
}
