//! vLLM's utility routes: `POST /tokenize`, `POST /detokenize`, `GET /version`.
//!
//! `/tokenize` takes `{"model", "prompt"}` (a completion prompt, tokenized as `/v1/completions`
//! does) or `{"model", "messages", "add_generation_prompt"}` (the chat template applied, as
//! `/v1/chat/completions` does) and answers `{"count", "max_model_len", "tokens"}`, plus
//! `"token_strs"` when `return_token_strs` is true. `/detokenize` takes `{"model", "tokens"}` and
//! answers `{"prompt"}`. Invariant: the ids `/tokenize` returns are exactly the prompt ids the
//! generation routes would use for the same input, and `/detokenize` refuses ids outside the
//! vocabulary instead of dropping them.

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::protocol::ChatMessageIn;
use crate::routes::{chat_prompt_ids, check_model, encode};
use crate::state::AppState;

#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessageIn>>,
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    return_token_strs: bool,
    #[serde(flatten)]
    extra: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
    #[serde(flatten)]
    extra: Map<String, Value>,
}

/// Refuses every field the route does not implement (these routes have no no-op fields).
fn refuse_extra(extra: &Map<String, Value>) -> Result<(), ApiError> {
    match extra.keys().next() {
        None => Ok(()),
        Some(name) => Err(ApiError::bad_request(
            Some(name),
            format!("{name} is not supported by this route"),
        )),
    }
}

pub async fn tokenize(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    check_model(&state, &req.model)?;
    refuse_extra(&req.extra)?;
    let tokens = match (&req.prompt, &req.messages) {
        (Some(p), None) => {
            if req.add_generation_prompt.is_some() {
                return Err(ApiError::bad_request(
                    Some("add_generation_prompt"),
                    "add_generation_prompt applies to messages only",
                ));
            }
            encode(&state, p)?
        }
        (None, Some(m)) => chat_prompt_ids(&state, m, req.add_generation_prompt.unwrap_or(true))?,
        _ => {
            return Err(ApiError::bad_request(
                Some("prompt"),
                "send exactly one of prompt and messages",
            ))
        }
    };
    let mut body = json!({
        "count": tokens.len(),
        "max_model_len": state.max_model_len,
        "tokens": tokens,
    });
    if req.return_token_strs {
        let strs: Vec<String> = tokens
            .iter()
            .map(|&t| state.tokenizer.token_text(t))
            .collect();
        body["token_strs"] = json!(strs);
    }
    Ok(Json(body))
}

pub async fn detokenize(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    check_model(&state, &req.model)?;
    refuse_extra(&req.extra)?;
    let vocab = state.engine.validator().vocab_size;
    if let Some(t) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_request(
            Some("tokens"),
            format!("token id {t} is out of the vocabulary (size {vocab})"),
        ));
    }
    Ok(Json(json!({"prompt": state.tokenizer.decode(&req.tokens)})))
}

pub async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}
