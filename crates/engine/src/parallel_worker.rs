//! [`ParallelWorker`]: a TP x PP group of [`RankWorker`]s and one connector, standing where one
//! worker stands.
//!
//! The connector is the process's: one NIXL agent over every rank's caches (registered with
//! [`KvConnectorWorker::register_rank_kv_caches`]), so a transfer, its lease and its
//! notifications are the instance's, and the peer pairs its layers and heads with each rank's
//! (`tandem_kv_connector::nixl::pairing`). Each step runs every rank on its own thread at once
//! (their forwards meet in the collectives); the sampled tokens are the sampling rank's (TP rank
//! 0 of the last stage); each rank checksums its own layers and heads of a finished load, and
//! the scheduler's merger compares a load only once every rank's record is in.
//!
//! Invariants: a rank that fails or panics aborts the world's collectives, so the step ends on
//! every rank (with the error) instead of hanging; the world is reset after such a step, once
//! every rank has returned, so the next step starts clean; every rank's sends are queued even
//! when the step failed (each send job is answered).

use std::panic::AssertUnwindSafe;

use tandem_kv_connector::base::KvConnectorWorker;
use tandem_parallel::{CpuWorld, ParallelConfig};

use crate::error::EngineError;
use crate::metrics as m;
use crate::model_worker::RankWorker;
use crate::scheduler_output::{ForwardOutput, SchedulerOutput, WorkerOutput};
use crate::worker::Worker;

/// The ranks of one instance and its connector, driven together.
pub struct ParallelWorker {
    parallel: ParallelConfig,
    /// In worker-index order (`pp_rank * tp + tp_rank`).
    ranks: Vec<RankWorker>,
    world: CpuWorld,
    connector: Box<dyn KvConnectorWorker>,
}

impl ParallelWorker {
    /// `ranks` in worker-index order, their models' collectives running over `world`; the
    /// connector registers every rank's caches.
    pub fn new(
        parallel: ParallelConfig,
        ranks: Vec<RankWorker>,
        world: CpuWorld,
        mut connector: Box<dyn KvConnectorWorker>,
    ) -> Result<Self, EngineError> {
        if ranks.len() != parallel.world_size() {
            return Err(EngineError::Execution(format!(
                "{} workers for TP {} x PP {}",
                ranks.len(),
                parallel.tp,
                parallel.pp
            )));
        }
        let caches = ranks.iter().map(RankWorker::kv_caches).collect();
        connector
            .register_rank_kv_caches(caches)
            .map_err(|e| EngineError::Execution(format!("registering KV caches: {e}")))?;
        let worker = ParallelWorker {
            parallel,
            ranks,
            world,
            connector,
        };
        worker.report_collective_seconds();
        Ok(worker)
    }

    /// Publishes each rank's collective time so far.
    fn report_collective_seconds(&self) {
        let seconds = self.world.seconds_in_collectives();
        for (rank, s) in self.parallel.ranks().zip(seconds) {
            metrics::gauge!(m::PARALLEL_COLLECTIVE_SECONDS,
                "tp_rank" => rank.tp_rank.to_string(), "pp_rank" => rank.pp_rank.to_string())
            .set(s);
        }
    }

    /// Every rank's forward at once; the sampling rank's output, or the root-cause error.
    fn forward_all(&mut self, step: &SchedulerOutput) -> Result<ForwardOutput, EngineError> {
        let world = &self.world;
        let results: Vec<Result<ForwardOutput, EngineError>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .enumerate()
                .map(|(i, rank)| {
                    std::thread::Builder::new()
                        .name(format!("tandem-rank-{i}"))
                        .spawn_scoped(s, move || {
                            let out =
                                std::panic::catch_unwind(AssertUnwindSafe(|| rank.forward(step)))
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
                    Err(e) => {
                        world.abort(&format!("cannot start the thread of rank {i}: {e}"));
                        Err(EngineError::Execution(format!(
                            "cannot start the thread of rank {i}: {e}"
                        )))
                    }
                })
                .collect()
        });
        // The first abort names the rank that failed and why; the others only say they were
        // aborted.
        let cause = world.aborted();
        if cause.is_some() {
            world.reset();
        }
        let driver = self.parallel.index(self.parallel.driver());
        let mut sampled = ForwardOutput::default();
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Ok(tokens) if i == driver => sampled = tokens,
                Ok(_) => {}
                Err(e) => return Err(cause.map_or(e, EngineError::Execution)),
            }
        }
        Ok(sampled)
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
    fn set_waker(&mut self, waker: tandem_kv_connector::base::Waker) {
        self.connector.set_waker(waker);
    }

    fn execute(&mut self, step: &SchedulerOutput) -> Result<WorkerOutput, EngineError> {
        for rank in &mut self.ranks {
            rank.begin_step(step);
        }
        let sampled = match self.connector.start_load_kv(&step.connector_metadata) {
            Ok(()) => self.forward_all(step),
            Err(e) => Err(EngineError::Execution(format!(
                "starting KV transfers: {e}"
            ))),
        };
        for rank in &mut self.ranks {
            rank.start_sends(step);
        }
        self.report_collective_seconds();
        let forward = sampled?;
        let mut out = WorkerOutput {
            sampled: forward.sampled,
            prompt_logprobs: forward.prompt_logprobs,
            ..Default::default()
        };
        out.connector_output = self.connector.get_finished();
        for rank in &mut self.ranks {
            out.checksum_records
                .extend(rank.end_step(&out.connector_output));
        }
        Ok(out)
    }
}
