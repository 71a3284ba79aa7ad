//! End-to-end KV checksums in the engine: the producer checksums a prompt's KV, the consumer
//! verifies every load against it before the request runs again.
//!
//! The checksum itself (definition, worker records, merge, wire format, verdicts) is
//! `tandem_kv_checksum`'s; this module wires it into the step loop:
//! - [`config`]: [`KvChecksumConfig`] (from `kv_transfer_config`) and [`FaultInjection`].
//! - `tracker` (scheduler side): which blocks each job covers, the workers' records per job,
//!   the payload a producer adds to its `kv_transfer_params`, a consumer's verdicts and metrics.
//! - [`worker`] (worker side): [`ChecksumWorker`], one per worker (TP rank x PP stage): sends on a
//!   side thread after the forward, loads synchronously in the step that reports them finished,
//!   faults injected into loaded blocks before they are checksummed.
//! - [`fault`]: what each injected fault does to the KV.
//!
//! Invariants:
//! - a job is named by (request, generation); records of any other generation are dropped, so a
//!   prefill that was preempted and redone never mixes two computations' values;
//! - a request's blocks are not freed (nor preempted) while a send job reads them: the scheduler
//!   holds them until every worker reported the job;
//! - a load is compared after the connector's own failures are handled (a failed load is never
//!   compared) and before the request can be scheduled again;
//! - under fail-closed a mismatched or unverified load is a KV load failure
//!   (`kv_load_failure_policy` decides), and its blocks never enter the prefix cache.

pub mod config;
pub mod fault;
pub(crate) mod tracker;
pub mod worker;

pub use config::{BlockFault, FaultInjection, FaultKind, KvChecksumConfig, WorkerGrid};
pub use worker::ChecksumWorker;
