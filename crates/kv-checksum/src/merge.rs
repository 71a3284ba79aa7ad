//! The scheduler side's merge: the records of every TP x PP worker of one request summed into
//! one value per (group, block position) — one per replica check on a consumer.
//!
//! Invariants:
//! - a result exists only once every worker of the grid reported (otherwise
//!   [`UnverifiedReason::NotAllWorkersReported`]);
//! - a group is usable only if every worker checksummed exactly the scheduled blocks (same
//!   positions, tokens and block ids, by digest); otherwise it is unverified
//!   ([`UnverifiedReason::OtherBlocksThanScheduled`]);
//! - fingerprints are summed per PP stage, one TP rank each (TP ranks of a stage hold the same
//!   layers and must agree), so the sum names the model's layers whatever the PP split;
//! - replica check `k` sums copy `k % R` of each part replicated on `R` ranks, for `k` below the
//!   largest `R`: every check covers each slice once, and every copy is in some check. A
//!   producer (replica 0 only) has its value in check 0.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::KvChecksumError;
use crate::record::{GroupOutcome, GroupValues, ReplicaKey, RequestRecord, SkipReason, WorkerId};
use crate::schedule::{ChecksumRequest, ScheduledGroup};
use crate::verdict::UnverifiedReason;

/// One group's merged checksums on one side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupChecks {
    /// Sum over PP stages of one TP rank's fingerprint.
    pub fingerprint: u64,
    pub block_size: usize,
    /// First block position.
    pub start: usize,
    /// First token covered (inside the first block).
    pub first_token: usize,
    pub num_tokens: usize,
    /// One vector of block values per replica check (at least one); check 0 is the producer's.
    pub checks: Vec<Vec<u64>>,
}

/// What one side knows about one group after the merge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MergedState {
    Computed(GroupChecks),
    /// Some worker (or the block selection) could not checksum the group.
    Skipped(SkipReason),
    /// The workers' records cannot be used for this group.
    Unverified(UnverifiedReason),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MergedGroup {
    pub group_id: usize,
    pub state: MergedState,
}

/// The merged checksums of one request on one side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MergedChecksums {
    pub tp_size: u32,
    pub num_tokens: usize,
    pub groups: Vec<MergedGroup>,
}

impl MergedChecksums {
    pub fn group(&self, group_id: usize) -> Option<&MergedState> {
        self.groups
            .iter()
            .find(|g| g.group_id == group_id)
            .map(|g| &g.state)
    }
}

/// Collects the records of one request from a TP x PP grid of workers.
#[derive(Debug, Clone)]
pub struct RecordMerger {
    tp_size: u32,
    pp_size: u32,
    request: ChecksumRequest,
    records: Vec<Option<RequestRecord>>,
}

impl RecordMerger {
    /// A merger for `request` (what the scheduler sent) over `tp_size x pp_size` workers
    /// (a size of 0 counts as 1).
    pub fn new(tp_size: u32, pp_size: u32, request: ChecksumRequest) -> Self {
        let (tp_size, pp_size) = (tp_size.max(1), pp_size.max(1));
        RecordMerger {
            tp_size,
            pp_size,
            request,
            records: vec![None; tp_size as usize * pp_size as usize],
        }
    }

    pub fn request(&self) -> &ChecksumRequest {
        &self.request
    }

    /// Adds one worker's record. A worker outside the grid, or one that already reported, is an
    /// error (and the record is dropped).
    pub fn add(&mut self, record: RequestRecord) -> Result<(), KvChecksumError> {
        let w = record.worker;
        if w.tp_rank >= self.tp_size || w.pp_rank >= self.pp_size {
            return Err(KvChecksumError::UnknownWorker {
                worker: w,
                tp_size: self.tp_size,
                pp_size: self.pp_size,
            });
        }
        let slot = &mut self.records[(w.pp_rank * self.tp_size + w.tp_rank) as usize];
        if slot.is_some() {
            return Err(KvChecksumError::DuplicateRecord(w));
        }
        *slot = Some(record);
        Ok(())
    }

    /// Whether every worker has reported.
    pub fn is_complete(&self) -> bool {
        self.records.iter().all(Option::is_some)
    }

    /// Workers that have not reported yet.
    pub fn missing(&self) -> Vec<WorkerId> {
        self.records
            .iter()
            .enumerate()
            .filter(|(_, r)| r.is_none())
            .map(|(i, _)| WorkerId {
                tp_rank: i as u32 % self.tp_size,
                pp_rank: i as u32 / self.tp_size,
            })
            .collect()
    }

    /// Sums the records, or `NotAllWorkersReported` while some worker is missing.
    pub fn finish(&self) -> Result<MergedChecksums, UnverifiedReason> {
        if !self.is_complete() {
            return Err(UnverifiedReason::NotAllWorkersReported);
        }
        let records: Vec<&RequestRecord> = self.records.iter().flatten().collect();
        let mut groups: Vec<MergedGroup> = self
            .request
            .groups
            .iter()
            .map(|sg| MergedGroup {
                group_id: sg.group_id,
                state: self.merge_group(sg, &records),
            })
            .collect();
        groups.extend(self.request.skipped.iter().map(|(id, r)| MergedGroup {
            group_id: *id,
            state: MergedState::Skipped(r.clone()),
        }));
        groups.sort_by_key(|g| g.group_id);
        Ok(MergedChecksums {
            tp_size: self.tp_size,
            num_tokens: self.request.num_tokens,
            groups,
        })
    }

    fn merge_group(&self, sg: &ScheduledGroup, records: &[&RequestRecord]) -> MergedState {
        let num_tokens = self.request.num_tokens;
        let digest = sg.digest(num_tokens);
        let nb = sg.block_ids.len();
        let mut stage_fingerprint: Vec<Option<u64>> = vec![None; self.pp_size as usize];
        let mut sums: BTreeMap<ReplicaKey, Vec<u64>> = BTreeMap::new();
        let mut skipped: Option<SkipReason> = None;
        let mut unverified: Option<UnverifiedReason> = None;
        for r in records {
            let mut mine = r.groups.iter().filter(|g| g.group_id == sg.group_id);
            let (Some(gr), None) = (mine.next(), mine.next()) else {
                unverified.get_or_insert(UnverifiedReason::OtherBlocksThanScheduled);
                continue;
            };
            match &mut stage_fingerprint[r.worker.pp_rank as usize] {
                Some(f) if *f != gr.fingerprint => {
                    unverified.get_or_insert(UnverifiedReason::WorkersDisagree);
                }
                f => *f = Some(gr.fingerprint),
            }
            match &gr.outcome {
                GroupOutcome::Skipped(reason) => {
                    skipped.get_or_insert_with(|| reason.clone());
                }
                GroupOutcome::Failed(_) => {
                    unverified.get_or_insert(UnverifiedReason::WorkerFailed);
                }
                GroupOutcome::Computed(v) => {
                    if !is_as_scheduled(v, sg, num_tokens, digest) {
                        unverified.get_or_insert(UnverifiedReason::OtherBlocksThanScheduled);
                        continue;
                    }
                    for part in &v.parts {
                        let sum = sums.entry(part.key).or_insert_with(|| vec![0; nb]);
                        for (s, x) in sum.iter_mut().zip(&part.values) {
                            *s = s.wrapping_add(*x);
                        }
                    }
                }
            }
        }
        if let Some(reason) = unverified {
            return MergedState::Unverified(reason);
        }
        if let Some(reason) = skipped {
            return MergedState::Skipped(reason);
        }
        let replicas = sums.keys().map(|k| k.replicas).max().unwrap_or(1);
        let checks = (0..replicas)
            .map(|k| {
                let mut check = vec![0u64; nb];
                for (key, sum) in &sums {
                    if key.index == k % key.replicas {
                        for (c, x) in check.iter_mut().zip(sum) {
                            *c = c.wrapping_add(*x);
                        }
                    }
                }
                check
            })
            .collect();
        MergedState::Computed(GroupChecks {
            fingerprint: stage_fingerprint
                .iter()
                .flatten()
                .fold(0u64, |a, f| a.wrapping_add(*f)),
            block_size: sg.block_size,
            start: sg.start,
            first_token: sg.first_token,
            num_tokens,
            checks,
        })
    }
}

/// Whether a worker's values cover exactly the scheduled blocks, with well-formed parts.
fn is_as_scheduled(v: &GroupValues, sg: &ScheduledGroup, num_tokens: usize, digest: u64) -> bool {
    let nb = sg.block_ids.len();
    let mut keys: Vec<ReplicaKey> = v.parts.iter().map(|p| p.key).collect();
    keys.sort();
    keys.dedup();
    v.block_size == sg.block_size
        && v.start == sg.start
        && v.first_token == sg.first_token
        && v.num_tokens == num_tokens
        && v.blocks_digest == digest
        && v.num_blocks == nb
        && keys.len() == v.parts.len()
        && v.parts
            .iter()
            .all(|p| p.values.len() == nb && p.key.is_valid())
}
