//! [`IncrementalChecksum`]: one request's checksums computed in parts, as its blocks become
//! readable (a load whose chunks land one after another), then assembled into the record
//! [`WorkerChecksums::checksum`] returns for the whole request at once.
//!
//! Why: a consumer that checksums a load only after its last byte landed has the whole checksum
//! on the path to the request's first token. Checksumming each chunk while the next one moves
//! leaves only the last chunk's share there.
//!
//! Invariants:
//! - every block position is computed exactly once: by the first [`IncrementalChecksum::add_ready`]
//!   whose predicate names its block, or by [`IncrementalChecksum::finish`];
//! - a position is computed with the same layers, columns and token range as the whole
//!   computation would use (the definition sums per block), so how the blocks were split never
//!   changes a value: the record equals [`WorkerChecksums::checksum`]'s for the same memory;
//! - a part the backend refuses fails its group ([`GroupOutcome::Failed`]): never a partial value.

use crate::backend::{BlockJob, ChecksumBackend, GroupJob, LayerJob};
use crate::record::{
    GroupOutcome, GroupRecord, GroupValues, ReplicaKey, ReplicaPart, RequestRecord, WorkerId,
};
use crate::schedule::ChecksumRequest;
use crate::worker::{block_jobs, values_shell, Role, WorkerChecksums};

/// One request's checksums on one worker, computed in parts. See the module docs.
#[derive(Debug, Clone)]
pub struct IncrementalChecksum {
    worker: WorkerId,
    groups: Vec<GroupProgress>,
}

#[derive(Debug, Clone)]
struct GroupProgress {
    group_id: usize,
    fingerprint: u64,
    state: GroupState,
}

#[derive(Debug, Clone)]
enum GroupState {
    /// Nothing to compute: the outcome is known.
    Known(GroupOutcome),
    Running(Box<RunningGroup>),
}

#[derive(Debug, Clone)]
struct RunningGroup {
    layers: Vec<LayerJob>,
    keys: Vec<ReplicaKey>,
    blocks: Vec<BlockJob>,
    /// Column-major: `values[column * blocks.len() + position]`.
    values: Vec<u64>,
    done: Vec<bool>,
    shell: GroupValues,
}

impl IncrementalChecksum {
    /// Plans `request`'s checksums on `setup`'s worker; nothing is computed yet.
    pub fn new(setup: &WorkerChecksums, role: Role, request: &ChecksumRequest) -> Self {
        let groups = request
            .groups
            .iter()
            .map(|sg| {
                let Some(p) = setup.group(sg.group_id) else {
                    // A group this worker holds no layer of (another PP stage's).
                    return GroupProgress {
                        group_id: sg.group_id,
                        fingerprint: 0,
                        state: GroupState::Known(GroupOutcome::Computed(values_shell(
                            sg,
                            request.num_tokens,
                        ))),
                    };
                };
                let state = match &p.state {
                    Err(reason) => GroupState::Known(GroupOutcome::Skipped(reason.clone())),
                    Ok(ready) if sg.block_size != ready.block_size => {
                        GroupState::Known(GroupOutcome::Failed(format!(
                            "scheduled block size {} differs from the cache's {}",
                            sg.block_size, ready.block_size
                        )))
                    }
                    Ok(ready) => match block_jobs(sg, request.num_tokens) {
                        Err(e) => GroupState::Known(GroupOutcome::Failed(e.to_string())),
                        Ok(blocks) => {
                            let (layers, keys) = ready.columns(role);
                            GroupState::Running(Box::new(RunningGroup {
                                values: vec![0; keys.len() * blocks.len()],
                                done: vec![false; blocks.len()],
                                layers,
                                keys,
                                blocks,
                                shell: values_shell(sg, request.num_tokens),
                            }))
                        }
                    },
                };
                GroupProgress {
                    group_id: sg.group_id,
                    fingerprint: p.fingerprint,
                    state,
                }
            })
            .collect();
        IncrementalChecksum {
            worker: setup.worker(),
            groups,
        }
    }

    /// Computes the positions not computed yet whose cache block `ready(group_id, block_id)`
    /// accepts (their bytes are in place and nothing writes them any more). Returns how many
    /// positions it computed.
    pub fn add_ready(
        &mut self,
        backend: &dyn ChecksumBackend,
        ready: impl Fn(usize, usize) -> bool,
    ) -> usize {
        let mut computed = 0;
        for g in &mut self.groups {
            let GroupState::Running(run) = &mut g.state else {
                continue;
            };
            let picked: Vec<usize> = (0..run.blocks.len())
                .filter(|&i| !run.done[i] && ready(g.group_id, run.blocks[i].block_id))
                .collect();
            if picked.is_empty() {
                continue;
            }
            let part: Vec<BlockJob> = picked.iter().map(|&i| run.blocks[i]).collect();
            let (n, nb) = (part.len(), run.blocks.len());
            let mut out = vec![0u64; run.keys.len() * n];
            let job = GroupJob {
                layers: &run.layers,
                blocks: &part,
                columns: run.keys.len(),
            };
            if let Err(e) = backend.checksum(&job, &mut out) {
                g.state = GroupState::Known(GroupOutcome::Failed(e.to_string()));
                continue;
            }
            for c in 0..run.keys.len() {
                for (j, &i) in picked.iter().enumerate() {
                    run.values[c * nb + i] = out[c * n + j];
                }
            }
            for &i in &picked {
                run.done[i] = true;
            }
            computed += n;
        }
        computed
    }

    /// Positions not computed yet, over every group.
    pub fn remaining(&self) -> usize {
        self.groups
            .iter()
            .map(|g| match &g.state {
                GroupState::Running(run) => run.done.iter().filter(|d| !**d).count(),
                GroupState::Known(_) => 0,
            })
            .sum()
    }

    /// Computes every position not computed yet and returns the request's record.
    pub fn finish(mut self, backend: &dyn ChecksumBackend) -> RequestRecord {
        self.add_ready(backend, |_, _| true);
        let groups = self
            .groups
            .into_iter()
            .map(|g| {
                let outcome = match g.state {
                    GroupState::Known(outcome) => outcome,
                    GroupState::Running(run) => {
                        let RunningGroup {
                            keys,
                            values,
                            mut shell,
                            blocks,
                            ..
                        } = *run;
                        let nb = blocks.len();
                        shell.parts = keys
                            .iter()
                            .enumerate()
                            .map(|(c, &key)| ReplicaPart {
                                key,
                                values: values[c * nb..(c + 1) * nb].to_vec(),
                            })
                            .collect();
                        GroupOutcome::Computed(shell)
                    }
                };
                GroupRecord {
                    group_id: g.group_id,
                    fingerprint: g.fingerprint,
                    outcome,
                }
            })
            .collect();
        RequestRecord {
            worker: self.worker,
            groups,
        }
    }
}
