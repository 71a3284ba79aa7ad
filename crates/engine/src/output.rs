//! What the engine sends back for a request, step by step.
//!
//! Invariant: a request's stream carries zero or more events without `finish`, then exactly one
//! event with `finish` set, then closes.

use serde_json::Value;

use crate::error::EngineError;
use crate::request::FinishReason;
use crate::sampling::TokenLogprob;

/// The outcome of one step for one request.
#[derive(Debug, Clone, Default)]
pub struct RequestEvent {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    /// With the first output token, when prompt logprobs were asked: one entry per prompt token,
    /// `None` for the first (nothing predicts it).
    pub prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    pub finish: Option<FinishReason>,
    /// Set with `finish`: the stop string that ended the request, if any.
    pub stop_reason: Option<String>,
    pub num_prompt_tokens: usize,
    pub num_output_tokens: usize,
    pub num_cached_tokens: usize,
    /// Set with `finish` on a producer: what a consumer needs to load this request's KV.
    pub kv_transfer_params: Option<Value>,
    /// Set with `finish` when the request failed.
    pub error: Option<EngineError>,
}
