//! [`ParallelWorker`]: a TP x PP group of [`ModelWorker`]s standing where one worker stands.
//!
//! Each step runs every rank on its own thread at once (their forwards meet in the collectives)
//! and merges what they return:
//! - sampled tokens come from the sampling rank only (TP rank 0 of the last stage);
//! - a transfer counts as finished only when every rank has reported it ([`TransferAggregator`]),
//!   since each rank moves only its own layers and heads; a failure on any rank fails the load;
//! - checksum records of every rank go to the scheduler, whose merger waits for all of them.
//!
//! Invariants: a rank that fails or panics aborts the world's collectives, so the step ends on
//! every rank (with the error) instead of hanging; the world is reset after such a step, once
//! every rank has returned, so the next step starts clean.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;

use tandem_kv_connector::base::ConnectorOutput;
use tandem_parallel::{CpuWorld, ParallelConfig};

use crate::error::EngineError;
use crate::model_worker::ModelWorker;
use crate::scheduler_output::{SchedulerOutput, WorkerOutput};
use crate::worker::Worker;

/// The ranks of one instance, driven together.
pub struct ParallelWorker {
    parallel: ParallelConfig,
    /// In worker-index order (`pp_rank * tp + tp_rank`).
    ranks: Vec<ModelWorker>,
    world: CpuWorld,
    transfers: TransferAggregator,
}

impl ParallelWorker {
    /// `ranks` in worker-index order, their models' collectives running over `world`.
    pub fn new(
        parallel: ParallelConfig,
        ranks: Vec<ModelWorker>,
        world: CpuWorld,
    ) -> Result<Self, EngineError> {
        if ranks.len() != parallel.world_size() {
            return Err(EngineError::Execution(format!(
                "{} workers for TP {} x PP {}",
                ranks.len(),
                parallel.tp,
                parallel.pp
            )));
        }
        Ok(ParallelWorker {
            parallel,
            transfers: TransferAggregator::new(ranks.len()),
            ranks,
            world,
        })
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "unknown panic".into())
}

impl Worker for ParallelWorker {
    fn execute(&mut self, step: &SchedulerOutput) -> Result<WorkerOutput, EngineError> {
        let world = &self.world;
        let results: Vec<Result<WorkerOutput, EngineError>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .enumerate()
                .map(|(i, rank)| {
                    std::thread::Builder::new()
                        .name(format!("tandem-rank-{i}"))
                        .spawn_scoped(s, move || {
                            let out =
                                std::panic::catch_unwind(AssertUnwindSafe(|| rank.execute(step)))
                                    .unwrap_or_else(|panic| {
                                        Err(EngineError::Execution(format!(
                                            "rank {i} panicked: {}",
                                            panic_message(panic.as_ref())
                                        )))
                                    });
                            if let Err(e) = &out {
                                world.abort(&format!("worker {i} failed: {e}"));
                            }
                            out
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(i, h)| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| {
                        Err(EngineError::Execution(format!("rank {i} thread died")))
                    }),
                    Err(e) => Err(EngineError::Execution(format!(
                        "cannot start the thread of rank {i}: {e}"
                    ))),
                })
                .collect()
        });
        if world.aborted().is_some() {
            world.reset();
        }
        let driver = self.parallel.index(self.parallel.driver());
        let mut sampled = Vec::new();
        let mut records = Vec::new();
        let mut connector_outputs = Vec::with_capacity(results.len());
        let mut first_error = None;
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Ok(out) => {
                    if i == driver {
                        sampled = out.sampled;
                    }
                    records.extend(out.checksum_records);
                    connector_outputs.push(out.connector_output);
                }
                // the root cause first: the other ranks' errors say they were aborted
                Err(e) => {
                    let aborted = e.to_string().contains("collective aborted");
                    if first_error.is_none() || !aborted {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        Ok(WorkerOutput {
            sampled,
            connector_output: self.transfers.merge(connector_outputs),
            checksum_records: records,
        })
    }
}

/// Counts each rank's report of a finished transfer, and reports the transfer when every rank
/// has (vLLM's rule for a TP group: each rank moves only its part of the KV).
#[derive(Debug)]
pub struct TransferAggregator {
    world_size: usize,
    sending: HashMap<u64, usize>,
    recving: HashMap<u64, usize>,
    /// Failure reasons of loads some rank reported failed, until every rank reported them.
    failures: HashMap<u64, String>,
}

impl TransferAggregator {
    pub fn new(world_size: usize) -> Self {
        TransferAggregator {
            world_size,
            sending: HashMap::new(),
            recving: HashMap::new(),
            failures: HashMap::new(),
        }
    }

    /// Merges one step's outputs of every rank (in worker-index order).
    pub fn merge(&mut self, outputs: Vec<ConnectorOutput>) -> ConnectorOutput {
        let mut merged = ConnectorOutput::default();
        for out in outputs {
            for id in out.finished_sending {
                if Self::count(&mut self.sending, id, self.world_size) {
                    merged.finished_sending.insert(id);
                }
            }
            for (id, reason) in out.failed_recving {
                self.failures.entry(id).or_insert(reason);
            }
            for id in out.finished_recving {
                if Self::count(&mut self.recving, id, self.world_size) {
                    merged.finished_recving.insert(id);
                    if let Some(reason) = self.failures.remove(&id) {
                        merged.failed_recving.insert(id, reason);
                    }
                }
            }
            merged.invalid_block_ids.extend(out.invalid_block_ids);
            for (id, payload) in out.kv_checksums {
                merged.kv_checksums.entry(id).or_insert(payload);
            }
            merged.stats.merge(out.stats);
        }
        merged
    }

    /// Adds one report of `id`; true when it was the last one.
    fn count(counts: &mut HashMap<u64, usize>, id: u64, world_size: usize) -> bool {
        let n = counts.entry(id).or_insert(0);
        *n += 1;
        if *n >= world_size {
            counts.remove(&id);
            true
        } else {
            false
        }
    }

    /// Transfers some rank reported and others have not yet.
    pub fn num_partial(&self) -> usize {
        self.sending.len() + self.recving.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(send: &[u64], recv: &[u64], failed: &[(u64, &str)]) -> ConnectorOutput {
        ConnectorOutput {
            finished_sending: send.iter().copied().collect(),
            finished_recving: recv.iter().copied().collect(),
            failed_recving: failed.iter().map(|(i, r)| (*i, r.to_string())).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_transfer_finishes_when_every_rank_reported_it() {
        let mut agg = TransferAggregator::new(3);
        let m = agg.merge(vec![
            out(&[1], &[7], &[]),
            out(&[1], &[], &[]),
            out(&[], &[7], &[]),
        ]);
        assert!(m.finished_sending.is_empty() && m.finished_recving.is_empty());
        assert_eq!(agg.num_partial(), 2);
        let m = agg.merge(vec![
            out(&[], &[], &[]),
            out(&[], &[7], &[]),
            out(&[1], &[], &[]),
        ]);
        assert_eq!(m.finished_sending.into_iter().collect::<Vec<_>>(), [1]);
        assert_eq!(m.finished_recving.into_iter().collect::<Vec<_>>(), [7]);
        assert_eq!(agg.num_partial(), 0);
    }

    #[test]
    fn one_rank_failing_fails_the_load_once_all_reported() {
        let mut agg = TransferAggregator::new(2);
        let m = agg.merge(vec![
            out(&[], &[5], &[(5, "peer died")]),
            out(&[], &[], &[]),
        ]);
        assert!(m.failed_recving.is_empty() && m.finished_recving.is_empty());
        let m = agg.merge(vec![out(&[], &[], &[]), out(&[], &[5], &[])]);
        assert!(m.finished_recving.contains(&5));
        assert_eq!(
            m.failed_recving.get(&5).map(String::as_str),
            Some("peer died")
        );
    }
}
