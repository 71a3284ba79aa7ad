//! A request inside the engine: its tokens, its progress through the KV cache, and its state.
//!
//! States: `Waiting -> Running -> Finished`, with `Running -> Preempted -> Running` when blocks run
//! out (its KV is dropped and recomputed) and `Waiting -> WaitingForRemoteKv -> Waiting` while a
//! connector loads its KV from another instance. Invariant: `num_computed_tokens <= num_tokens()`,
//! and the KV of tokens `[0, num_computed_tokens)` is in the request's blocks.

use std::time::Instant;

use serde_json::Value;

use crate::detokenizer::IncrementalDetokenizer;
use crate::output::RequestEvent;
use crate::sampling::{SamplingParams, TokenLogprob};

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    WaitingForRemoteKv,
    Running,
    Preempted,
    Finished(FinishReason),
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the model's context length.
    Length,
    /// The client went away or cancelled.
    Abort,
    /// The engine could not complete it (e.g. a KV load failure under policy `fail`).
    Error,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// What a caller submits.
#[derive(Debug, Clone)]
pub struct NewRequest {
    /// The id known outside (X-Request-Id); need not be unique.
    pub external_id: String,
    pub prompt_token_ids: Vec<u32>,
    pub params: SamplingParams,
    pub kv_transfer_params: Option<Value>,
}

/// The engine's record of one request.
#[derive(Debug)]
pub struct Request {
    pub id: u64,
    pub external_id: String,
    /// Prompt then output tokens.
    pub all_token_ids: Vec<u32>,
    pub num_prompt_tokens: usize,
    pub params: SamplingParams,
    pub status: RequestStatus,
    pub num_computed_tokens: usize,
    /// Tokens of the prompt found in the local prefix cache at first schedule.
    pub num_cached_tokens: Option<usize>,
    /// Tokens loaded from a remote instance.
    pub num_external_tokens: usize,
    pub kv_transfer_params: Option<Value>,
    pub num_preemptions: u32,
    pub arrival: Instant,
    /// When it was first given blocks (to run, or to wait for remote KV): the end of its queueing.
    pub first_scheduled_at: Option<Instant>,
    pub first_token_at: Option<Instant>,
    pub last_token_at: Option<Instant>,
    pub detokenizer: IncrementalDetokenizer,
    pub sink: tokio::sync::mpsc::UnboundedSender<RequestEvent>,
    /// Whether the worker has seen this request (its sampler exists).
    pub sent_to_worker: bool,
    /// Its KV load failed and it waits to recompute locally: the next admission counts the
    /// tokens it computes again.
    pub recomputing_failed_load: bool,
    /// With prompt logprobs asked: one entry per prompt token, filled as steps compute them
    /// (sent with the first output token); empty otherwise.
    pub prompt_logprobs: Vec<Option<TokenLogprob>>,
}

impl Request {
    pub fn new(
        id: u64,
        new: NewRequest,
        sink: tokio::sync::mpsc::UnboundedSender<RequestEvent>,
    ) -> Self {
        let n = new.prompt_token_ids.len();
        let detokenizer = IncrementalDetokenizer::new(
            n,
            new.params.skip_special_tokens,
            new.params.stop.clone(),
            new.params.include_stop_str_in_output,
        );
        Request {
            id,
            external_id: new.external_id,
            all_token_ids: new.prompt_token_ids,
            num_prompt_tokens: n,
            params: new.params,
            status: RequestStatus::Waiting,
            num_computed_tokens: 0,
            num_cached_tokens: None,
            num_external_tokens: 0,
            kv_transfer_params: new.kv_transfer_params,
            num_preemptions: 0,
            arrival: Instant::now(),
            first_scheduled_at: None,
            first_token_at: None,
            last_token_at: None,
            detokenizer,
            sink,
            sent_to_worker: false,
            recomputing_failed_load: false,
            prompt_logprobs: Vec::new(),
        }
    }

    /// Whether this step's rows must return prompt logprobs (asked, and not yet sent).
    pub fn wants_prompt_logprobs(&self) -> bool {
        self.params.prompt_logprobs.is_some() && self.num_output_tokens() == 0
    }

    pub fn num_tokens(&self) -> usize {
        self.all_token_ids.len()
    }
    pub fn num_output_tokens(&self) -> usize {
        self.all_token_ids.len() - self.num_prompt_tokens
    }
    pub fn prompt_token_ids(&self) -> &[u32] {
        &self.all_token_ids[..self.num_prompt_tokens]
    }
    pub fn output_token_ids(&self) -> &[u32] {
        &self.all_token_ids[self.num_prompt_tokens..]
    }
    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }
}
