//! The HTTP API of one instance: OpenAI-compatible endpoints, health and metrics.
//!
//! Validation happens here, once, before anything reaches the engine: model name, prompt shape,
//! sampling ranges (the engine's validator), context length. Every error leaves through
//! [`ApiError`].

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tandem_engine::SamplingParams;

use tandem_kv_connector::auth::KV_AUTH_HEADER;
use tandem_kv_connector::params::TransferRequest;
use tandem_kv_connector::pull::{ReleaseOutcome, CLAIM_PATH, HANDSHAKE_PATH, RELEASE_PATH};
use tandem_kv_connector::push::REGISTER_PATH;
use tandem_kv_connector::KvConnectorError;

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generate::{respond, Endpoint, GenPrompt, Generation};
use crate::protocol::{
    ChatMessageIn, ChatRequest, CommonParams, CompletionRequest, MessageContent, ModelCard,
    PromptInput,
};
use crate::state::AppState;

/// Header naming a request across proxy, prefill and decode.
pub const X_REQUEST_ID: &str = "x-request-id";

/// Routes open without `--api-key`: probes, and the KV routes (they check the KV transfer secret
/// and signed params themselves; a consumer calls them without the instance's API key).
pub const OPEN_PATHS: &[&str] = &[
    "/health",
    "/metrics",
    HANDSHAKE_PATH,
    CLAIM_PATH,
    RELEASE_PATH,
    REGISTER_PATH,
];

/// The router of one instance.
pub fn app(state: AppState) -> Router {
    let limit = state.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(crate::tokenize::tokenize))
        .route("/detokenize", post(crate::tokenize::detokenize))
        .route("/version", get(crate::tokenize::version))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route(HANDSHAKE_PATH, get(kv_handshake))
        .route(CLAIM_PATH, post(kv_claim))
        .route(RELEASE_PATH, post(kv_release))
        .route(REGISTER_PATH, post(kv_push_register))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn not_found() -> Response {
    let body = json!({"error": {"message": "not found", "type": "NotFoundError", "param": null, "code": 404}});
    (StatusCode::NOT_FOUND, Json(body)).into_response()
}

async fn models(State(state): State<AppState>) -> Json<serde_json::Value> {
    let card = ModelCard {
        id: state.served_model_name().to_string(),
        object: "model",
        created: state.created,
        owned_by: "tandem",
        root: state.model_root.clone(),
        max_model_len: state.max_model_len,
    };
    Json(json!({"object": "list", "data": [card]}))
}

async fn health(State(state): State<AppState>) -> Response {
    if state.engine.is_alive() {
        StatusCode::OK.into_response()
    } else {
        let body = json!({"error": {"message": "the engine is not running", "type": "ServiceUnavailableError", "param": null, "code": 503}});
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    match &state.prometheus {
        Some(h) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4",
            )],
            h.render(),
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "metrics are not enabled").into_response(),
    }
}

/// A refusal of KV transfer params or of a peer request: counted by reason, then answered.
fn kv_refused(e: KvConnectorError) -> ApiError {
    if let Some(reason) = e.refusal_reason() {
        tracing::warn!(reason, "KV transfer refused: {e}");
        metrics::counter!(tandem_engine::metrics::KV_TRANSFER_REFUSED_TOTAL, "reason" => reason)
            .increment(1);
    }
    ApiError::KvTransfer(e)
}

/// The NIXL handshake of a P/D instance: what a consumer needs to read this instance's blocks
/// (with a deployment secret, only for requests signed with it).
async fn kv_handshake(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let Some(peer) = &state.kv_peer else {
        return not_found().await;
    };
    let auth = headers.get(KV_AUTH_HEADER).and_then(|v| v.to_str().ok());
    match peer.handshake(auth) {
        Ok(Some(j)) => (
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            j.to_string(),
        )
            .into_response(),
        Ok(None) => {
            let body = json!({"error": {"message": "the KV transfer agent is not ready", "type": "ServiceUnavailableError", "param": null, "code": 503}});
            (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
        }
        Err(e) => kv_refused(e).into_response(),
    }
}

/// `POST /v1/kv/claim`: a consumer asks to read a lease's blocks (see `KvPeerService::claim`).
async fn kv_claim(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> Result<Response, ApiError> {
    let Some(peer) = &state.kv_peer else {
        return Ok(not_found().await);
    };
    peer.claim(&body).map_err(kv_refused)?;
    Ok(Json(json!({"claimed": true})).into_response())
}

/// `POST /v1/kv/release`: the proxy gives back an unclaimed lease (see `KvPeerService::release`).
async fn kv_release(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> Result<Response, ApiError> {
    let Some(peer) = &state.kv_peer else {
        return Ok(not_found().await);
    };
    let outcome = match peer.release(&body).map_err(kv_refused)? {
        ReleaseOutcome::Released => "released",
        ReleaseOutcome::Claimed => "claimed",
        ReleaseOutcome::Unknown => "unknown",
    };
    Ok(Json(json!({"release": outcome})).into_response())
}

/// `POST /v1/kv/push/register`: a push consumer registers its blocks for a transfer (see
/// `KvPeerService::register_push`); 404 on an instance that is not in push mode.
async fn kv_push_register(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> Result<Response, ApiError> {
    let Some(peer) = &state.kv_peer else {
        return Ok(not_found().await);
    };
    let auth = headers.get(KV_AUTH_HEADER).and_then(|v| v.to_str().ok());
    if !peer.register_push(auth, &body).map_err(kv_refused)? {
        return Ok(not_found().await);
    }
    Ok((StatusCode::ACCEPTED, Json(json!({"registered": true}))).into_response())
}

fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.chars().all(|c| c.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}

pub(crate) fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if !state.model_names.iter().any(|n| n == m) => {
            Err(ApiError::ModelNotFound(m.clone()))
        }
        _ => Ok(()),
    }
}

/// Sampling parameters from the shared fields; `max_tokens` defaults to what the context allows.
fn sampling_params(
    state: &AppState,
    c: &CommonParams,
    max_tokens: Option<usize>,
    prompt_len: usize,
    logprobs: Option<usize>,
) -> Result<SamplingParams, ApiError> {
    check_decode_room(state, c, prompt_len)?;
    if c.prompt_logprobs.is_some() {
        refuse_prompt_logprobs_in_pd(c, "prompt_logprobs")?;
    }
    let max_tokens = match max_tokens {
        Some(m) => m,
        None => state.max_model_len.saturating_sub(prompt_len).max(1),
    };
    Ok(SamplingParams {
        temperature: c.temperature.unwrap_or(1.0),
        top_p: c.top_p.unwrap_or(1.0),
        top_k: c.top_k.unwrap_or(0),
        seed: c.seed.map(|s| s as u64),
        max_tokens,
        min_tokens: c.min_tokens.unwrap_or(0),
        ignore_eos: c.ignore_eos,
        stop: c.stop.clone().map(|s| s.into_vec()).unwrap_or_default(),
        stop_token_ids: c.stop_token_ids.clone().unwrap_or_default(),
        include_stop_str_in_output: c.include_stop_str_in_output,
        logprobs,
        prompt_logprobs: c.prompt_logprobs,
        skip_special_tokens: c.skip_special_tokens.unwrap_or(true),
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
        min_p: c.min_p.unwrap_or(0.0),
        logit_bias: logit_bias(c)?,
        guide: None,
    })
}

/// Prompt logprobs need the prompt computed where the answer is made: a P/D consumer loads it
/// and a producer's answer is not the client's, so `param` is refused in P/D.
fn refuse_prompt_logprobs_in_pd(c: &CommonParams, param: &str) -> Result<(), ApiError> {
    if is_local(&c.kv_transfer_params) {
        return Ok(());
    }
    Err(ApiError::bad_request(
        Some(param),
        format!(
            "{param} needs the prompt's logprobs, which P/D does not compute where the answer \
             is made; send this request to a single instance"
        ),
    ))
}

/// OpenAI's `logit_bias` (token ids as strings) as pairs; the engine checks ids and ranges.
fn logit_bias(c: &CommonParams) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = &c.logit_bias else {
        return Ok(Vec::new());
    };
    map.iter()
        .map(|(id, &bias)| {
            let id = id.trim().parse::<u32>().map_err(|_| {
                ApiError::bad_request(
                    Some("logit_bias"),
                    format!("logit_bias keys must be token ids, got {id:?}"),
                )
            })?;
            Ok((id, bias))
        })
        .collect()
}

/// A producer request (`do_remote_decode`) carrying the decode's output limit
/// (`decode_max_tokens`, set by the proxy) is refused here, before any prefill, when the prompt
/// leaves no room for it: the decode instance (same model, same limits) would refuse it anyway.
fn check_decode_room(
    state: &AppState,
    c: &CommonParams,
    prompt_len: usize,
) -> Result<(), ApiError> {
    let Some(params) = c.kv_transfer_params.as_ref().and_then(|p| p.as_object()) else {
        return Ok(());
    };
    if params.get("do_remote_decode") != Some(&serde_json::Value::Bool(true)) {
        return Ok(());
    }
    let Some(limit) = params.get("decode_max_tokens").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let n = limit.as_u64().filter(|&n| n >= 1).ok_or_else(|| {
        ApiError::bad_request(
            Some("kv_transfer_params"),
            format!("decode_max_tokens must be an integer of at least 1, got {limit}"),
        )
    })?;
    let requested = (prompt_len as u64).saturating_add(n);
    if requested > state.max_model_len as u64 {
        return Err(ApiError::Engine(
            tandem_engine::EngineError::ContextLengthExceeded {
                max_model_len: state.max_model_len,
                requested: usize::try_from(requested).unwrap_or(usize::MAX),
                prompt: prompt_len,
                max_tokens: usize::try_from(n).unwrap_or(usize::MAX),
            },
        ));
    }
    Ok(())
}

fn check_n(c: &CommonParams) -> Result<usize, ApiError> {
    let n = c.n.unwrap_or(1);
    if !(1..=16).contains(&n) {
        return Err(ApiError::bad_request(
            Some("n"),
            format!("n must be between 1 and 16, got {n}"),
        ));
    }
    Ok(n)
}

/// The shape of `kv_transfer_params`, then (on a P/D instance) the admission check: signed,
/// unexpired, from an allowed producer. Before anything reaches the engine or the network.
fn check_transfer_params(state: &AppState, c: &CommonParams) -> Result<(), ApiError> {
    match &c.kv_transfer_params {
        None | Some(serde_json::Value::Null) | Some(serde_json::Value::Object(_)) => {}
        Some(_) => {
            return Err(ApiError::bad_request(
                Some("kv_transfer_params"),
                "kv_transfer_params must be an object",
            ))
        }
    }
    if let Some(admission) = &state.kv_admission {
        admission
            .check(c.kv_transfer_params.as_ref())
            .map_err(kv_refused)?;
    }
    Ok(())
}

async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    check_model(&state, &req.common.model)?;
    crate::fields::check_extra_fields(&req.common.extra)?;
    let n = check_n(&req.common)?;
    check_transfer_params(&state, &req.common)?;
    enum Source {
        Text(String),
        Ids(Vec<u32>),
    }
    let texts: Vec<Source> = match req.prompt {
        PromptInput::Text(t) => vec![Source::Text(t)],
        PromptInput::Tokens(ids) => vec![Source::Ids(ids)],
        PromptInput::TextBatch(v) => v.into_iter().map(Source::Text).collect(),
        PromptInput::TokensBatch(v) => v.into_iter().map(Source::Ids).collect(),
    };
    if texts.is_empty() {
        return Err(ApiError::bad_request(
            Some("prompt"),
            "prompt must not be an empty list",
        ));
    }
    let best_of = req.best_of.unwrap_or(n);
    if best_of < n || best_of > 16 {
        return Err(ApiError::bad_request(
            Some("best_of"),
            format!("best_of must be between n ({n}) and 16, got {best_of}"),
        ));
    }
    if best_of > n && req.common.stream {
        return Err(ApiError::bad_request(
            Some("best_of"),
            "best_of larger than n cannot be streamed (the best are known only at the end)",
        ));
    }
    if texts.len() * best_of > MAX_CHOICES {
        return Err(ApiError::bad_request(
            Some("prompt"),
            format!(
                "{} prompts x {best_of} sequences exceed {MAX_CHOICES} sequences per request",
                texts.len()
            ),
        ));
    }
    if texts.len() > 1 && !is_local(&req.common.kv_transfer_params) {
        return Err(ApiError::bad_request(
            Some("prompt"),
            "a list of prompts cannot be served in P/D (one kv_transfer_params per request); \
             send one prompt per request",
        ));
    }
    let guide = crate::guided::requested(&req.common)?
        .map(|r| crate::guided::compile(&state, &r))
        .transpose()?;
    let mut prompts = Vec::with_capacity(texts.len());
    for prompt in texts {
        let (ids, text) = match prompt {
            Source::Text(t) => (encode(&state, &t)?, Some(t)),
            Source::Ids(ids) => (ids, None),
        };
        let mut params = sampling_params(
            &state,
            &req.common,
            req.common.max_tokens,
            ids.len(),
            req.logprobs,
        )?;
        params.guide = guide.clone();
        if let Some(k) = req.logprobs.filter(|_| req.echo) {
            // The echoed prompt's tokens carry their logprobs too.
            refuse_prompt_logprobs_in_pd(&req.common, "echo")?;
            params.prompt_logprobs = Some(params.prompt_logprobs.unwrap_or(0).max(k));
        }
        let echo = req
            .echo
            .then(|| text.unwrap_or_else(|| state.tokenizer.decode(&ids)));
        prompts.push(GenPrompt { ids, params, echo });
    }
    let mut g = generation(Endpoint::Completions, &headers, req.common, prompts, n);
    g.best_of = best_of;
    respond(state, g).await
}

/// Most engine requests one API request may make (prompts x `n`).
const MAX_CHOICES: usize = 128;

/// Whether `kv_transfer_params` ask for nothing P/D (the connector's own classification).
fn is_local(params: &Option<serde_json::Value>) -> bool {
    matches!(
        TransferRequest::parse(params.as_ref(), 0, 1),
        Ok(TransferRequest::Local)
    )
}

/// The engine-ready form of a validated request, from the fields both endpoints share.
fn generation(
    endpoint: Endpoint,
    headers: &HeaderMap,
    common: CommonParams,
    prompts: Vec<GenPrompt>,
    n: usize,
) -> Generation {
    Generation {
        endpoint,
        request_id: request_id(headers),
        prompts,
        n,
        best_of: n,
        stream: common.stream,
        include_usage: common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
        return_token_ids: common.return_token_ids,
        prompt_logprobs: common.prompt_logprobs,
        tool_calls: None,
        kv_transfer_params: common.kv_transfer_params.filter(|v| !v.is_null()),
    }
}

/// The chat template applied to `messages` (text content only), tokenized.
pub(crate) fn chat_prompt_ids(
    state: &AppState,
    messages: &[ChatMessageIn],
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request(
            Some("messages"),
            "messages must not be empty",
        ));
    }
    let mut turns = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if !["system", "user", "assistant", "developer", "tool"].contains(&m.role.as_str()) {
            return Err(ApiError::bad_request(
                Some("messages"),
                format!("messages[{i}].role `{}` is not one of system, user, assistant, developer, tool", m.role),
            ));
        }
        let content = match &m.content {
            None => String::new(),
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(ApiError::bad_request(
                            Some("messages"),
                            format!(
                                "messages[{i}]: content parts of type `{}` are not supported",
                                p.kind
                            ),
                        ));
                    }
                    s.push_str(p.text.as_deref().unwrap_or(""));
                }
                s
            }
        };
        turns.push((m.role.clone(), content));
    }
    state
        .tokenizer
        .encode_chat(&turns, add_generation_prompt)
        .map_err(|e| {
            ApiError::bad_request(
                Some("messages"),
                format!("cannot apply the chat template: {e}"),
            )
        })
}

pub(crate) fn encode(state: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    state.tokenizer.encode_prompt(text).map_err(|e| {
        ApiError::bad_request(Some("prompt"), format!("cannot tokenize the prompt: {e}"))
    })
}

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    check_model(&state, &req.common.model)?;
    crate::fields::check_extra_fields(&req.common.extra)?;
    let n = check_n(&req.common)?;
    check_transfer_params(&state, &req.common)?;
    let prompt_ids = chat_prompt_ids(
        &state,
        &req.messages,
        req.add_generation_prompt.unwrap_or(true),
    )?;
    let logprobs = if req.logprobs {
        Some(req.top_logprobs.unwrap_or(0))
    } else if req.top_logprobs.is_some() {
        return Err(ApiError::bad_request(
            Some("top_logprobs"),
            "top_logprobs requires logprobs: true",
        ));
    } else {
        None
    };
    let max_tokens = req.max_completion_tokens.or(req.common.max_tokens);
    let mut params = sampling_params(&state, &req.common, max_tokens, prompt_ids.len(), logprobs)?;
    let forcing = crate::tools::forcing(req.tools.as_deref(), req.tool_choice.as_ref())?;
    let own = crate::guided::requested(&req.common)?;
    let wanted = crate::guided::one_of(
        own.into_iter()
            .chain(forcing.as_ref().map(|f| f.guide.clone()))
            .collect(),
    )?;
    params.guide = wanted
        .map(|r| crate::guided::compile(&state, &r))
        .transpose()?;
    let prompt = GenPrompt {
        ids: prompt_ids,
        params,
        echo: None,
    };
    let mut g = generation(Endpoint::Chat, &headers, req.common, vec![prompt], n);
    g.tool_calls = forcing.map(|f| f.mode);
    respond(state, g).await
}
