//! What the scheduler hands the workers each step, and what they hand back.
//!
//! The worker is in-process, so each step carries full block tables rather than diffs. Checksum
//! work rides along: blocks a producer checksums after the forward (`sends`), and blocks a consumer
//! checksums when their load finishes (`recvs`); every worker answers each job with exactly one
//! [`ChecksumRecord`], tagged with the job's generation.

use tandem_kv_cache::BlockId;
use tandem_kv_checksum::{ChecksumRequest, RequestRecord};
use tandem_kv_connector::base::{ConnectorMetadata, ConnectorOutput};

use crate::kv_checksum::BlockFault;
use crate::sampling::{SamplingParams, TokenLogprob};

/// One request's work in a step.
#[derive(Debug, Clone)]
pub struct ScheduledRequest {
    pub request_id: u64,
    /// Present the first time the worker sees the request.
    pub sampling: Option<SamplingParams>,
    /// With `sampling`, when its repetition penalty is on: the request's tokens so far (the
    /// prompt), which the penalty covers besides the output.
    pub penalty_context: Option<Vec<u32>>,
    /// The tokens to run through the model this step.
    pub token_ids: Vec<u32>,
    /// Position of `token_ids[0]` (the request's computed tokens before this step).
    pub start_position: usize,
    /// One block table per KV cache group (indexed by group id), or one all groups share
    /// (see [`tandem_models::SeqBatch::block_tables`]); a sliding group's entries before its
    /// window are [`tandem_kv_cache::NULL_BLOCK`].
    pub block_tables: Vec<Vec<BlockId>>,
    /// The step reaches the request's last known token: sample the next one.
    pub sample: bool,
    /// With prompt logprobs asked: the prompt token each of this step's rows predicts, from the
    /// first row on (fewer than `token_ids` where the prompt ends); empty otherwise.
    pub prompt_logprob_targets: Vec<u32>,
}

/// Blocks of one request for every worker to checksum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChecksumJob {
    pub request_id: u64,
    /// Names this job among the request's jobs: a record of an older generation (a prefill that
    /// was preempted and redone, a load that ended) is stale and dropped by the scheduler.
    pub generation: u64,
    /// The scheduler's block selection (per group: positions, tokens, block ids).
    pub blocks: ChecksumRequest,
    /// Loads only: a fault to inject into the loaded blocks before they are checksummed.
    pub fault: Option<BlockFault>,
}

/// Checksum work of a step.
///
/// - `sends`: a producer's prompts that this step's forward completes; workers checksum them
///   after the forward, off the step's critical path, and report them in a later step.
/// - `recvs`: loads that start this step; workers keep them until the connector reports the
///   load finished and checksum it then, in that step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChecksumWork {
    pub sends: Vec<ChecksumJob>,
    pub recvs: Vec<ChecksumJob>,
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

/// Log-probabilities of prompt tokens computed in one step for one request.
#[derive(Debug, Clone)]
pub struct PromptLogprobs {
    pub request_id: u64,
    /// Prompt position of the token of `logprobs[0]` (at least 1: the first token has none).
    pub first_position: usize,
    pub logprobs: Vec<TokenLogprob>,
}

/// What a rank's forward returns: sampled tokens and prompt logprobs (none on ranks that do
/// not sample).
#[derive(Debug, Default)]
pub struct ForwardOutput {
    pub sampled: Vec<SampledToken>,
    pub prompt_logprobs: Vec<PromptLogprobs>,
}

/// Which side of a transfer a checksum record is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChecksumSide {
    /// A producer's prompt ([`ChecksumWork::sends`]).
    Send,
    /// A consumer's load ([`ChecksumWork::recvs`]).
    Recv,
}

/// One worker's checksums of one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChecksumRecord {
    pub request_id: u64,
    /// The job's [`ChecksumJob::generation`].
    pub generation: u64,
    pub side: ChecksumSide,
    pub record: RequestRecord,
}

/// What a worker returns for a step.
#[derive(Debug, Default)]
pub struct WorkerOutput {
    pub sampled: Vec<SampledToken>,
    pub prompt_logprobs: Vec<PromptLogprobs>,
    pub connector_output: ConnectorOutput,
    /// Checksum records finished since the last step (every record of a job exactly once).
    pub checksum_records: Vec<ChecksumRecord>,
}
