//! The engine: requests, the scheduler and its hooks, workers, sampling, the step loop.
//!
//! - [`request`]: a request's tokens, progress and state machine.
//! - [`sampling`]: sampling parameters, validation and the sampler.
//! - [`detokenizer`]: incremental text and stop strings.
//! - [`scheduler`]: continuous batching over the paged KV cache, chunked prefill, preemption,
//!   and the connector hooks (remote KV, delayed free).
//! - [`scheduler_output`]: what a step asks of workers and what they answer.
//! - [`kv_checksum`]: end-to-end KV checksums (config, scheduler side, worker side, faults).
//! - [`worker`]: the worker interface; [`model_worker`]: the worker that runs the model.
//! - [`core`]: the engine thread and its handle.
//! - [`debug_fault`]: the deliberate engine fault of the end-to-end tests.
//! - [`metrics`]: every metric name.

pub mod core;
pub mod debug_fault;
pub mod detokenizer;
pub mod error;
pub mod kv_checksum;
pub mod metrics;
pub mod model_worker;
pub mod output;
pub mod parallel_worker;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod scheduler_output;
pub mod worker;

pub use crate::core::{EngineHandle, RequestStream, RequestValidator};
pub use debug_fault::{EngineFault, FaultyWorker};
pub use detokenizer::Detokenize;
pub use error::EngineError;
pub use kv_checksum::{ChecksumWorker, FaultInjection, FaultKind, KvChecksumConfig, WorkerGrid};
pub use output::RequestEvent;
pub use parallel_worker::ParallelWorker;
pub use request::{FinishReason, NewRequest, RequestStatus};
pub use sampling::{SamplingParams, TokenLogprob};
pub use scheduler::{KvLoadFailurePolicy, Scheduler, SchedulerConfig, SchedulerStats};
pub use worker::Worker;
