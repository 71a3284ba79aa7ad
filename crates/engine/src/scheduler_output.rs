//! What the scheduler hands the workers each step, and what they hand back.
//!
//! The worker is in-process, so each step carries full block tables rather than diffs. Checksum
//! work rides along: blocks a producer checksums after the forward (`sends`), and blocks a consumer
//! checksums when their load finishes (`recvs`); workers answer with one record per task.

use tandem_kv_cache::BlockId;
use tandem_kv_connector::base::{ConnectorMetadata, ConnectorOutput};

use crate::sampling::{SamplingParams, TokenLogprob};

/// One request's work in a step.
#[derive(Debug, Clone)]
pub struct ScheduledRequest {
    pub request_id: u64,
    /// Present the first time the worker sees the request.
    pub sampling: Option<SamplingParams>,
    /// The tokens to run through the model this step.
    pub token_ids: Vec<u32>,
    /// Position of `token_ids[0]` (the request's computed tokens before this step).
    pub start_position: usize,
    pub block_table: Vec<BlockId>,
    /// The step reaches the request's last known token: sample the next one.
    pub sample: bool,
}

/// Blocks of one request to checksum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChecksumTask {
    pub request_id: u64,
    /// Block ids in order of position; position of the first is `first_block`.
    pub block_ids: Vec<BlockId>,
    pub first_block: usize,
    /// Tokens of the request the checksums cover (the last block may be partial).
    pub num_tokens: usize,
}

/// Checksum work of a step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChecksumWork {
    pub sends: Vec<ChecksumTask>,
    pub recvs: Vec<ChecksumTask>,
}

impl ChecksumWork {
    pub fn is_empty(&self) -> bool {
        self.sends.is_empty() && self.recvs.is_empty()
    }
}

/// The scheduler's decisions for one step.
#[derive(Debug, Default)]
pub struct SchedulerOutput {
    pub step: u64,
    pub scheduled: Vec<ScheduledRequest>,
    /// Requests that ended since the last step: workers drop their state.
    pub finished_request_ids: Vec<u64>,
    pub connector_metadata: ConnectorMetadata,
    pub checksum_work: ChecksumWork,
}

impl SchedulerOutput {
    pub fn num_tokens(&self) -> usize {
        self.scheduled.iter().map(|s| s.token_ids.len()).sum()
    }
    pub fn has_model_work(&self) -> bool {
        !self.scheduled.is_empty()
    }
}

/// A token sampled for a request.
#[derive(Debug, Clone)]
pub struct SampledToken {
    pub request_id: u64,
    pub token_id: u32,
    pub logprob: Option<TokenLogprob>,
}

/// A worker's checksum result for one task (opaque to the scheduler until checksums are wired).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChecksumReport {
    pub request_id: u64,
    pub is_send: bool,
    pub first_block: usize,
    pub values: Vec<u64>,
}

/// What a worker returns for a step.
#[derive(Debug, Default)]
pub struct WorkerOutput {
    pub sampled: Vec<SampledToken>,
    pub connector_output: ConnectorOutput,
    pub checksum_reports: Vec<ChecksumReport>,
}
