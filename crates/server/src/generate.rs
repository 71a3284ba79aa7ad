//! Turns an API request into engine requests and engine events into OpenAI responses.
//!
//! One API request with `n` choices for each of its prompts (`/v1/completions` takes a list)
//! becomes `prompts x n` engine requests (seeds `seed + j` for choice `j` of a prompt); choice
//! `i` answers prompt `i / n`, as vLLM numbers them. A streamed
//! response sends one chunk per engine event, then a usage chunk if asked, then `[DONE]`; an error
//! after the stream started is sent as an `{"error": ...}` event before `[DONE]`. Dropping the
//! response (client gone) drops the engine streams, which aborts the requests.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use tandem_engine::{
    EngineError, NewRequest, RequestEvent, RequestStream, SamplingParams, TokenLogprob,
};

use crate::error::ApiError;
use crate::protocol::{PromptTokensDetails, Usage};
use crate::state::AppState;

/// Which endpoint's response shape to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// An API request ready for the engine.
#[derive(Debug, Clone)]
pub struct Generation {
    pub endpoint: Endpoint,
    pub request_id: String,
    /// One or more prompts (a list only on `/v1/completions`), each answered `n` times.
    pub prompts: Vec<GenPrompt>,
    pub n: usize,
    /// Sequences generated per prompt (`best_of`, at least `n`): the `n` with the highest
    /// cumulative logprob are answered. Equal to `n` when not asked for.
    pub best_of: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
    /// vLLM's `prompt_logprobs`: answered with this many alternatives per prompt token (per
    /// choice on `/v1/completions`, once on chat).
    pub prompt_logprobs: Option<usize>,
    /// Chat with a tool choice that forces a call: how its output becomes `tool_calls`.
    pub tool_calls: Option<crate::tools::ToolMode>,
    pub kv_transfer_params: Option<Value>,
}

/// One prompt of a [`Generation`].
#[derive(Debug, Clone)]
pub struct GenPrompt {
    pub ids: Vec<u32>,
    pub params: SamplingParams,
    /// The prompt's text, put before each of its choices' text (`echo`).
    pub echo: Option<String>,
}

impl Generation {
    /// The prompt choice `i` answers.
    fn prompt_of(&self, i: usize) -> &GenPrompt {
        &self.prompts[i / self.n.max(1)]
    }

    /// Sequences generated per prompt.
    fn per_prompt(&self) -> usize {
        self.best_of.max(self.n).max(1)
    }

    fn total_prompt_tokens(&self) -> usize {
        self.prompts.iter().map(|p| p.ids.len()).sum()
    }

    fn wants_logprobs(&self) -> bool {
        self.prompts.iter().any(|p| p.params.logprobs.is_some())
    }
}

impl GenPrompt {
    /// With `echo` and `logprobs`: the alternatives per echoed prompt token.
    fn echo_logprobs(&self) -> Option<usize> {
        self.echo.as_ref().and(self.params.logprobs)
    }
}

/// One finished choice.
#[derive(Debug, Default)]
struct Choice {
    text: String,
    token_ids: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    finish: Option<RequestEvent>,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn usage(prompt: usize, completion: usize, cached: usize) -> Usage {
    Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: prompt + completion,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: cached,
        },
    }
}

fn submit_all(state: &AppState, g: &Generation) -> Result<Vec<RequestStream>, ApiError> {
    let per = g.per_prompt();
    (0..g.prompts.len() * per)
        .map(|i| {
            let prompt = &g.prompts[i / per];
            let mut params = prompt.params.clone();
            params.seed = params.seed.map(|s| s.wrapping_add((i % per) as u64));
            if per > g.n && params.logprobs.is_none() {
                // Ranked by cumulative logprob: each sampled token's is needed.
                params.logprobs = Some(0);
            }
            let new = NewRequest {
                external_id: g.request_id.clone(),
                prompt_token_ids: prompt.ids.clone(),
                params,
                kv_transfer_params: g.kv_transfer_params.clone(),
            };
            state.engine.submit(new).map_err(ApiError::from)
        })
        .collect()
}

fn logprobs_json(state: &AppState, endpoint: Endpoint, lps: &[TokenLogprob]) -> Value {
    match endpoint {
        Endpoint::Chat => {
            let content: Vec<Value> = lps
                .iter()
                .map(|lp| {
                    let tok = state.tokenizer.token_text(lp.token_id);
                    json!({
                        "token": tok,
                        "logprob": lp.logprob,
                        "bytes": tok.as_bytes(),
                        "top_logprobs": lp.top.iter().map(|(id, l)| {
                            let t = state.tokenizer.token_text(*id);
                            json!({"token": t, "logprob": l, "bytes": t.as_bytes()})
                        }).collect::<Vec<_>>(),
                    })
                })
                .collect();
            json!({ "content": content })
        }
        Endpoint::Completions => {
            let tokens: Vec<String> = lps
                .iter()
                .map(|lp| state.tokenizer.token_text(lp.token_id))
                .collect();
            let token_logprobs: Vec<f32> = lps.iter().map(|lp| lp.logprob).collect();
            let top: Vec<Value> = lps
                .iter()
                .map(|lp| {
                    let m: serde_json::Map<String, Value> = lp
                        .top
                        .iter()
                        .map(|(id, l)| (state.tokenizer.token_text(*id), json!(l)))
                        .collect();
                    Value::Object(m)
                })
                .collect();
            json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top})
        }
    }
}

/// vLLM's `prompt_logprobs`: per prompt token, `null` for the first (nothing predicts it), else
/// the token and its `top` most likely alternatives keyed by token id, each with its logprob,
/// rank and text.
fn prompt_logprobs_json(state: &AppState, lps: &[Option<TokenLogprob>], top: usize) -> Value {
    let entry = |id: u32, logprob: f32, rank: usize| json!({"logprob": logprob, "rank": rank, "decoded_token": state.tokenizer.token_text(id)});
    lps.iter()
        .map(|lp| {
            let Some(lp) = lp else {
                return Value::Null;
            };
            let mut m = serde_json::Map::new();
            m.insert(
                lp.token_id.to_string(),
                entry(lp.token_id, lp.logprob, lp.rank),
            );
            for (i, &(id, l)) in lp.top.iter().take(top).enumerate() {
                m.entry(id.to_string())
                    .or_insert_with(|| entry(id, l, i + 1));
            }
            Value::Object(m)
        })
        .collect()
}

/// `echo` with `logprobs` on `/v1/completions`: the prompt's tokens go before the output's in
/// the `logprobs` object, the first with `null` logprob and alternatives, as vLLM answers.
fn prepend_prompt_logprobs(
    state: &AppState,
    logprobs: &mut Value,
    ids: &[u32],
    lps: &[Option<TokenLogprob>],
    top: usize,
) {
    let mut prepend = |key: &str, items: Vec<Value>| {
        if let Some(Value::Array(a)) = logprobs.get_mut(key) {
            a.splice(0..0, items);
        }
    };
    let tokens = ids
        .iter()
        .map(|&id| json!(state.tokenizer.token_text(id)))
        .collect();
    let values = lps
        .iter()
        .map(|lp| json!(lp.as_ref().map(|lp| lp.logprob)))
        .collect();
    let tops = lps
        .iter()
        .map(|lp| {
            let Some(lp) = lp else {
                return Value::Null;
            };
            let mut m = serde_json::Map::new();
            m.insert(state.tokenizer.token_text(lp.token_id), json!(lp.logprob));
            for &(id, l) in lp.top.iter().take(top) {
                m.entry(state.tokenizer.token_text(id)).or_insert(json!(l));
            }
            Value::Object(m)
        })
        .collect();
    prepend("tokens", tokens);
    prepend("token_logprobs", values);
    prepend("top_logprobs", tops);
}

fn response_id(endpoint: Endpoint, request_id: &str) -> String {
    match endpoint {
        Endpoint::Chat => format!("chatcmpl-{request_id}"),
        Endpoint::Completions => format!("cmpl-{request_id}"),
    }
}

/// Runs the generation and answers in the requested form.
pub async fn respond(state: AppState, g: Generation) -> Result<Response, ApiError> {
    let streams = submit_all(&state, &g)?;
    let request_id = axum::http::HeaderValue::from_str(&g.request_id).ok();
    let mut response = if g.stream {
        stream_response(state, g, streams).into_response()
    } else {
        full_response(state, g, streams).await?
    };
    // The request's id, as the client sent it in X-Request-Id or as generated.
    if let Some(id) = request_id {
        response
            .headers_mut()
            .insert(crate::routes::X_REQUEST_ID, id);
    }
    Ok(response)
}

async fn full_response(
    state: AppState,
    g: Generation,
    streams: Vec<RequestStream>,
) -> Result<Response, ApiError> {
    let results = futures::future::join_all(streams.into_iter().map(|mut s| async move {
        let mut c = Choice::default();
        while let Some(mut ev) = s.next().await {
            if ev.prompt_logprobs.is_some() {
                c.prompt_logprobs = ev.prompt_logprobs.take();
            }
            c.text.push_str(&ev.text);
            c.token_ids.extend(&ev.token_ids);
            c.logprobs.extend(ev.logprobs.iter().cloned());
            if ev.finish.is_some() {
                c.finish = Some(ev);
                break;
            }
        }
        c
    }))
    .await;
    let (results, discarded) = best_of(&g, results)?;
    let mut choices = Vec::new();
    let (mut completion, mut cached, prompt) = (discarded, 0, g.total_prompt_tokens());
    let mut kv_params = Value::Null;
    let batch = g.prompts.len() > 1;
    // Chat answers the prompt's logprobs once, at the top level.
    let mut chat_prompt_logprobs = None;
    for (i, c) in results.into_iter().enumerate() {
        let fin = c.finish.ok_or(ApiError::Engine(EngineError::EngineDead))?;
        if let Some(e) = fin.error {
            return Err(ApiError::Engine(e));
        }
        let this_prompt = g.prompt_of(i);
        completion += fin.num_output_tokens;
        if i % g.n == 0 {
            // Once per prompt (its choices share the prompt's cache hits).
            cached += fin.num_cached_tokens;
        }
        if i == 0 {
            kv_params = fin.kv_transfer_params.clone().unwrap_or(Value::Null);
        }
        let finish_reason = fin.finish.map(|f| f.as_str());
        let mut logprobs = if this_prompt.params.logprobs.is_some() {
            logprobs_json(&state, g.endpoint, &c.logprobs)
        } else {
            Value::Null
        };
        let prompt_lps = c.prompt_logprobs.as_deref().unwrap_or_default();
        if let Some(top) = this_prompt.echo_logprobs() {
            prepend_prompt_logprobs(&state, &mut logprobs, &this_prompt.ids, prompt_lps, top);
        }
        let prompt_logprobs = g
            .prompt_logprobs
            .filter(|_| i == 0 || g.endpoint == Endpoint::Completions)
            .map(|top| prompt_logprobs_json(&state, prompt_lps, top));
        let calls = g
            .tool_calls
            .as_ref()
            .filter(|_| fin.finish == Some(tandem_engine::FinishReason::Stop))
            .and_then(|mode| crate::tools::calls(mode, &c.text, &g.request_id, i));
        let mut choice = match (g.endpoint, calls) {
            (Endpoint::Chat, Some(calls)) => json!({
                "index": i,
                "message": {"role": "assistant", "content": null, "tool_calls": calls},
                "logprobs": logprobs,
                "finish_reason": "tool_calls",
                "stop_reason": fin.stop_reason,
            }),
            (Endpoint::Chat, None) => json!({
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": fin.stop_reason,
            }),
            (Endpoint::Completions, _) => {
                let text = match &this_prompt.echo {
                    Some(p) => format!("{p}{}", c.text),
                    None => c.text,
                };
                json!({
                    "index": i,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": fin.stop_reason,
                })
            }
        };
        if g.return_token_ids {
            choice["token_ids"] = json!(c.token_ids);
            if batch {
                choice["prompt_token_ids"] = json!(this_prompt.ids);
            }
        }
        if let Some(p) = prompt_logprobs {
            match g.endpoint {
                Endpoint::Completions => choice["prompt_logprobs"] = p,
                Endpoint::Chat => chat_prompt_logprobs = Some(p),
            }
        }
        choices.push(choice);
    }
    let object = match g.endpoint {
        Endpoint::Chat => "chat.completion",
        Endpoint::Completions => "text_completion",
    };
    let mut body = json!({
        "id": response_id(g.endpoint, &g.request_id),
        "object": object,
        "created": now_secs(),
        "model": state.served_model_name(),
        "choices": choices,
        "usage": usage(prompt, completion, cached),
        "kv_transfer_params": kv_params,
    });
    if g.return_token_ids && !batch {
        body["prompt_token_ids"] = json!(g.prompts[0].ids);
    }
    if let Some(p) = chat_prompt_logprobs {
        body["prompt_logprobs"] = p;
    }
    Ok(Json(body).into_response())
}

/// With `best_of`, keeps the `n` choices of each prompt with the highest cumulative logprob
/// (best first, as vLLM orders them), and returns the output tokens of the others, which the
/// usage still counts since they were generated. Without, the choices as they are. A failed
/// sequence fails the request, kept or not.
fn best_of(g: &Generation, results: Vec<Choice>) -> Result<(Vec<Choice>, usize), ApiError> {
    let per = g.per_prompt();
    if per == g.n {
        return Ok((results, 0));
    }
    let mut out = Vec::with_capacity(g.prompts.len() * g.n);
    let mut discarded = 0;
    let mut it = results.into_iter();
    for _ in 0..g.prompts.len() {
        let mut group: Vec<Choice> = it.by_ref().take(per).collect();
        for c in &group {
            if let Some(e) = c.finish.as_ref().and_then(|f| f.error.clone()) {
                return Err(ApiError::Engine(e));
            }
        }
        group.sort_by(|a, b| b.cumulative_logprob().total_cmp(&a.cumulative_logprob()));
        discarded += group[g.n.min(group.len())..]
            .iter()
            .filter_map(|c| c.finish.as_ref())
            .map(|f| f.num_output_tokens)
            .sum::<usize>();
        group.truncate(g.n);
        out.extend(group);
    }
    Ok((out, discarded))
}

impl Choice {
    fn cumulative_logprob(&self) -> f64 {
        self.logprobs.iter().map(|l| l.logprob as f64).sum()
    }
}

fn sse_json(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

fn stream_response(
    state: AppState,
    g: Generation,
    streams: Vec<RequestStream>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let created = now_secs();
    let id = response_id(g.endpoint, &g.request_id);
    let model = state.served_model_name().to_string();
    let object = match g.endpoint {
        Endpoint::Chat => "chat.completion.chunk",
        Endpoint::Completions => "text_completion",
    };
    let chunk = move |choices: Value| json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
    // Each choice's events, tagged with its index; merged as they come.
    let tagged = streams.into_iter().enumerate().map(|(i, s)| {
        stream::unfold(s, |mut s| async move { s.next().await.map(|ev| (ev, s)) })
            .map(move |ev| (i, ev))
            .boxed()
    });
    let merged = stream::select_all(tagged);
    let mut prelude = Vec::new();
    let num_choices = g.prompts.len() * g.n;
    let batch = g.prompts.len() > 1;
    if g.endpoint == Endpoint::Chat {
        let first: Vec<Value> = (0..num_choices)
            .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
            .collect();
        let mut c = chunk(json!(first));
        if g.return_token_ids {
            c["prompt_token_ids"] = json!(g.prompts[0].ids);
        }
        prelude.push(c);
    } else if g.prompts.iter().any(|p| p.echo.is_some()) || g.return_token_ids {
        let first: Vec<Value> = (0..num_choices)
            .map(|i| {
                let p = g.prompt_of(i);
                let mut c = json!({"index": i, "text": p.echo.clone().unwrap_or_default(), "logprobs": null, "finish_reason": null});
                if g.return_token_ids && batch {
                    c["prompt_token_ids"] = json!(p.ids);
                }
                c
            })
            .collect();
        let mut c = chunk(json!(first));
        if g.return_token_ids && !batch {
            c["prompt_token_ids"] = json!(g.prompts[0].ids);
        }
        prelude.push(c);
    }
    let usage_state = std::sync::Arc::new(parking_lot::Mutex::new((
        g.total_prompt_tokens(),
        0usize,
        0usize,
    )));
    let usage_end = usage_state.clone();
    let endpoint = g.endpoint;
    let want_logprobs = g.wants_logprobs();
    let prompt_logprobs_top = g.prompt_logprobs;
    // A forced tool call is sent whole with the choice's last event (its arguments are known
    // to parse only then); until then its deltas are empty.
    let tool_mode = g
        .tool_calls
        .clone()
        .filter(|_| g.endpoint == Endpoint::Chat);
    let request_id = g.request_id.clone();
    let mut tool_text = vec![String::new(); num_choices];
    // Per choice, with `echo` and `logprobs`: the prompt and its alternatives per token.
    let echo_logprobs: Vec<Option<(Vec<u32>, usize)>> = (0..num_choices)
        .map(|i| {
            let p = g.prompt_of(i);
            p.echo_logprobs().map(|top| (p.ids.clone(), top))
        })
        .collect();
    let n = g.n.max(1);
    let return_ids = g.return_token_ids;
    let include_usage = g.include_usage;
    let chunk2 = chunk.clone();
    let body = merged.map(move |(i, ev)| {
        if let Some(err) = &ev.error {
            let (_, body) = ApiError::Engine(err.clone()).parts();
            return sse_json(&body);
        }
        if ev.finish.is_some() {
            let mut u = usage_state.lock();
            u.1 += ev.num_output_tokens;
            if i % n == 0 {
                u.2 += ev.num_cached_tokens;
            }
        }
        let mut logprobs = if want_logprobs && !ev.logprobs.is_empty() {
            logprobs_json(&state, endpoint, &ev.logprobs)
        } else {
            Value::Null
        };
        let prompt_lps = ev.prompt_logprobs.as_deref();
        if let (Some(lps), Some((ids, top))) = (prompt_lps, &echo_logprobs[i]) {
            prepend_prompt_logprobs(&state, &mut logprobs, ids, lps, *top);
        }
        let prompt_logprobs = prompt_lps
            .zip(prompt_logprobs_top)
            .map(|(lps, top)| prompt_logprobs_json(&state, lps, top));
        let finish_reason = ev.finish.map(|f| f.as_str());
        let mut choice = match endpoint {
            Endpoint::Chat => json!({
                "index": i,
                "delta": {"content": ev.text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }),
            Endpoint::Completions => json!({
                "index": i,
                "text": ev.text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }),
        };
        if ev.finish.is_some() {
            choice["stop_reason"] = json!(ev.stop_reason);
        }
        if let Some(mode) = &tool_mode {
            tool_text[i].push_str(&ev.text);
            if ev.finish.is_none() {
                choice["delta"] = json!({});
            } else {
                let text = std::mem::take(&mut tool_text[i]);
                let calls = (ev.finish == Some(tandem_engine::FinishReason::Stop))
                    .then(|| crate::tools::calls(mode, &text, &request_id, i))
                    .flatten();
                match calls {
                    Some(calls) => {
                        let deltas: Vec<Value> = calls
                            .into_iter()
                            .enumerate()
                            .map(|(k, mut c)| {
                                c["index"] = json!(k);
                                c
                            })
                            .collect();
                        choice["delta"] = json!({ "tool_calls": deltas });
                        choice["finish_reason"] = json!("tool_calls");
                    }
                    None => choice["delta"] = json!({ "content": text }),
                }
            }
        }
        if return_ids {
            choice["token_ids"] = json!(ev.token_ids);
        }
        if let (Endpoint::Completions, Some(p)) = (endpoint, &prompt_logprobs) {
            choice["prompt_logprobs"] = p.clone();
        }
        let mut c = chunk2(json!([choice]));
        if let (Endpoint::Chat, Some(p)) = (endpoint, prompt_logprobs) {
            if i == 0 {
                c["prompt_logprobs"] = p;
            }
        }
        if ev.finish.is_some() {
            if let Some(kvp) = &ev.kv_transfer_params {
                c["kv_transfer_params"] = kvp.clone();
            }
        }
        sse_json(&c)
    });
    let tail = stream::once(async move {
        if include_usage {
            let (p, c, cached) = *usage_end.lock();
            let mut last = chunk(json!([]));
            last["usage"] = json!(usage(p, c, cached));
            Some(sse_json(&last))
        } else {
            None
        }
    })
    .filter_map(|e| async move { e })
    .chain(stream::once(async { Event::default().data("[DONE]") }));
    let all = stream::iter(prelude.into_iter().map(|c| sse_json(&c)))
        .chain(body)
        .chain(tail)
        .map(Ok);
    Sse::new(all)
}
