//! The OpenAI-compatible request and response bodies, as JSON sees them.
//!
//! Requests are typed strictly: a wrong type is a 422, a value out of range a 400. Fields no
//! struct here claims are collected in [`CommonParams::extra`] and judged by [`crate::fields`]:
//! refused (400) when they would change the output, else accepted (unknown ones logged once).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A string or a list of strings (`stop`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

/// `prompt` of `/v1/completions`: text or token ids, one or a batch of one.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
    TextBatch(Vec<String>),
    TokensBatch(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub n: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<StringOrList>,
    pub stop_token_ids: Option<Vec<u32>>,
    /// Any 64-bit integer; a negative one is accepted as vLLM does (its two's complement).
    pub seed: Option<i64>,
    pub min_tokens: Option<usize>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub skip_special_tokens: Option<bool>,
    #[serde(default)]
    pub include_stop_str_in_output: bool,
    #[serde(default)]
    pub return_token_ids: bool,
    pub kv_transfer_params: Option<Value>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub min_p: Option<f32>,
    /// Token id (as a string, OpenAI's form) to a bias added to its logit.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// vLLM's: the logprob of every prompt token with this many most likely alternatives.
    pub prompt_logprobs: Option<usize>,
    /// Structured outputs (see [`crate::guided`]): OpenAI's form and vLLM's.
    pub response_format: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub structured_outputs: Option<Value>,
    /// Every other field of the request (see [`crate::fields`]).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    /// Completions' `logprobs` is the number of top entries.
    pub logprobs: Option<usize>,
    #[serde(default)]
    pub echo: bool,
    /// Sequences generated per prompt, of which the `n` with the highest cumulative logprob
    /// are returned (at least `n`; not with `stream`).
    pub best_of: Option<usize>,
    #[serde(flatten)]
    pub common: CommonParams,
}

/// Message content: a string or a list of typed parts (only text parts are supported).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    pub content: Option<MessageContent>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    pub max_completion_tokens: Option<usize>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<usize>,
    pub add_generation_prompt: Option<bool>,
    /// Functions the model may call (see [`crate::tools`]).
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    #[serde(flatten)]
    pub common: CommonParams,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `/v1/models` entry.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// The model's file or directory.
    pub root: String,
    pub max_model_len: usize,
}
