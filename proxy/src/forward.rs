//! The P/D flow of one request, from the client's body to the decode instance's streamed answer.
//!
//! 1. Parse the body (a JSON object, else 400), drop the client's `kv_transfer_params`, check
//!    what needs no model (`request::validate_client_body`, else 400 naming the field), and
//!    check that some decode instance is in rotation (else 503, before any prefill).
//! 2. Prefill: lease the least-loaded healthy prefill instance, POST the one-token copy
//!    (`request::prefill_body`) within `prefill_timeout`, read its `kv_transfer_params`.
//! 3. Decode: lease a decode instance, POST the client's body plus those params, and answer the
//!    client with the decode instance's status, content type and body, relayed chunk by chunk.
//!    If the decode call fails (connect, timeout, error status), the producer's blocks are
//!    released at once (`release`). If an SSE body breaks mid-stream, the client's stream ends
//!    with an error event and `data: [DONE]` (`error::mid_stream_error_event`); any other body
//!    that breaks is cut (the client sees a truncated answer).
//!
//! With `--kv-mode push`, steps 2 and 3 start together (`push_request`): both calls carry one new
//! transfer id, the decode instance registers its blocks with the producer, and the producer
//! WRITEs the KV into them; the prefill's connect is not retried on another instance (the decode
//! call already names it).
//!
//! Invariants: one `X-Request-Id` (the client's, else a new UUID) goes on both upstream calls and
//! on the answer. Upstream calls carry the proxy's own key (`ProxyState::upstream`), never the
//! client's `Authorization`. A failed *connect* (nothing sent) marks the instance unhealthy and is retried
//! once on another instance of the role; nothing else is retried. The decode lease lives inside
//! the relayed body, so a client that goes away drops the body, the lease and the upstream
//! response (reqwest then closes that connection, which aborts the generation upstream); a
//! client gone before the answer cancels the handler, whose dropped leases and requests do the
//! same. Every request is counted once in `REQUESTS_TOTAL`: errors when they are answered,
//! relayed bodies when they end or are dropped, cancelled handlers by `Pending`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde_json::{Map, Value};
use tracing::Instrument;

use crate::config::KvMode;
use crate::error::{is_openai_error, mid_stream_error_event, ProxyError};
use crate::pool::{Instance, Lease, Role};
use crate::release::spawn_release;
use crate::request::{
    decode_body, kv_transfer_params, parse_client_body, prefill_body, validate_client_body,
    ClientBody, KvParamsError, KV_TRANSFER_PARAMS, X_REQUEST_ID,
};
use crate::state::ProxyState;
use crate::telemetry;

/// Longest client `X-Request-Id` taken as is; a longer or non-printable one is replaced.
const MAX_REQUEST_ID_LEN: usize = 256;
/// Most bytes read from an upstream's error body.
const MAX_ERROR_BODY_BYTES: usize = 1 << 20;
/// Response headers of the decode instance relayed to the client.
const RELAYED_HEADERS: [HeaderName; 2] = [header::CONTENT_TYPE, header::CACHE_CONTROL];

/// The OpenAI routes the proxy serves.
#[derive(Debug, Clone, Copy)]
enum Route {
    Completions,
    ChatCompletions,
    Models,
}

impl Route {
    fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::ChatCompletions => "/v1/chat/completions",
            Route::Models => "/v1/models",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Route::Completions => "completions",
            Route::ChatCompletions => "chat_completions",
            Route::Models => "models",
        }
    }
}

/// What one client request carries into its upstream calls.
#[derive(Clone)]
struct Ctx {
    state: ProxyState,
    route: Route,
    request_id: String,
    started: Instant,
}

/// `POST /v1/completions`.
pub(crate) async fn completions(
    State(state): State<ProxyState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(state, Route::Completions, headers, Some(body)).await
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    State(state): State<ProxyState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(state, Route::ChatCompletions, headers, Some(body)).await
}

/// `GET /v1/models`, answered by a decode instance.
pub(crate) async fn models(State(state): State<ProxyState>, headers: HeaderMap) -> Response {
    handle(state, Route::Models, headers, None).await
}

async fn handle(
    state: ProxyState,
    route: Route,
    headers: HeaderMap,
    body: Option<Result<Bytes, BytesRejection>>,
) -> Response {
    let ctx = Ctx {
        state,
        route,
        request_id: request_id(&headers),
        started: Instant::now(),
    };
    let span = tracing::debug_span!("proxy", request_id = %ctx.request_id, route = route.label());
    // Counts the request if this future is dropped before it has an answer (client gone).
    let mut pending = Pending {
        route: route.label(),
        answered: false,
    };
    let result = async {
        match body {
            Some(body) => pd_request(&ctx, body).await,
            None => models_request(&ctx).await,
        }
    }
    .instrument(span)
    .await;
    pending.answered = true;
    let mut response = result.unwrap_or_else(|error| {
        telemetry::request_finished(route.label(), error.code());
        error.into_response()
    });
    if let Ok(value) = HeaderValue::from_str(&ctx.request_id) {
        response.headers_mut().insert(X_REQUEST_ID, value);
    }
    response
}

/// A request still waiting for its answer; dropping it (the client went away and the server
/// cancelled the handler) counts the request as `client_disconnected`. Marked `answered` once
/// the answer (or its error) exists, from which point the answer counts the request.
struct Pending {
    route: &'static str,
    answered: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        tracing::debug!(route = self.route, "client went away before the answer");
        telemetry::request_finished(self.route, telemetry::OUTCOME_CLIENT_DISCONNECTED);
    }
}

/// The client's `X-Request-Id` if it is short and printable, else a new UUID.
fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|id| {
            !id.is_empty()
                && id.len() <= MAX_REQUEST_ID_LEN
                && id.bytes().all(|b| b.is_ascii_graphic())
        })
        .map(str::to_owned)
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
}

async fn pd_request(
    ctx: &Ctx,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ProxyError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ProxyError::BodyTooLarge {
                limit: ctx.state.settings().max_body_bytes,
            }
        } else {
            ProxyError::InvalidBody {
                message: rejection.body_text(),
            }
        }
    })?;
    let client_body = parse_client_body(&bytes)?;
    validate_client_body(&client_body)?;
    // A prefill whose KV no decode instance could take would only pin the producer's blocks.
    if !ctx.state.pool(Role::Decode).has_healthy() {
        return Err(ProxyError::NoHealthyInstance { role: Role::Decode });
    }

    if ctx.state.settings().kv_mode == KvMode::Push {
        return push_request(ctx, client_body).await;
    }
    let prefill = prefill_body(&client_body);
    let (producer, kv) = with_connect_retry(&ctx.state, Role::Prefill, |lease| {
        prefill_once(ctx, lease, &prefill)
    })
    .await?;
    let kv = kv.ok_or_else(|| ProxyError::MissingKvTransferParams {
        url: producer.clone(),
    })?;
    telemetry::prefill_took(ctx.started.elapsed().as_secs_f64());

    let decode = decode_body(client_body, kv.clone());
    let result = with_connect_retry(&ctx.state, Role::Decode, |lease| {
        decode_once(ctx, lease, &decode)
    })
    .await;
    if let Err(error) = &result {
        tracing::info!(%error, "decode call failed; releasing the producer's KV blocks");
        spawn_release(&ctx.state, &producer, &ctx.request_id, kv);
    }
    result
}

/// Push mode: the prefill and the decode call start together, carrying one new transfer id;
/// the decode instance registers its blocks with the producer, which WRITEs the KV into them
/// when its prefill is done. The decode instance's answer is the client's.
///
/// The prefill runs as its own task. If it fails before the decode instance answered, its
/// error is the client's and the decode call is dropped (which aborts it upstream); if the
/// decode call fails first, the prefill is aborted the same way. Once the decode instance
/// answers, the prefill is left to finish (a late failure is logged: the decode instance then
/// fails or recomputes its load by policy when its wait ends).
async fn push_request(ctx: &Ctx, client_body: ClientBody) -> Result<Response, ProxyError> {
    let transfer_id = uuid::Uuid::new_v4().simple().to_string();
    let lease = ctx.state.pool(Role::Prefill).acquire(None)?;
    let producer = lease.instance().clone();
    let (host, port) = host_port(producer.url()).ok_or_else(|| {
        ProxyError::Config(format!(
            "prefill URL {} has no host and port a decode instance can reach",
            producer.url()
        ))
    })?;
    let mut prefill = prefill_body(&client_body);
    if let Some(Value::Object(params)) = prefill.get_mut(KV_TRANSFER_PARAMS) {
        params.insert("transfer_id".into(), Value::String(transfer_id.clone()));
    }
    let mut params = Map::new();
    params.insert("do_remote_prefill".into(), Value::Bool(true));
    params.insert("transfer_id".into(), Value::String(transfer_id));
    params.insert("remote_host".into(), Value::String(host));
    params.insert("remote_port".into(), Value::from(port));
    let decode = decode_body(client_body, params);

    let prefill_ctx = ctx.clone();
    let prefill_task = tokio::spawn(
        async move {
            let result = prefill_once(&prefill_ctx, lease, &prefill).await;
            let result = observe(Role::Prefill, &producer, result);
            if result.is_ok() {
                telemetry::prefill_took(prefill_ctx.started.elapsed().as_secs_f64());
            }
            result.map(|_| ())
        }
        .in_current_span(),
    );
    // Aborts the prefill if this request is dropped or fails before the decode answers.
    let mut prefill_task = AbortOnDrop(Some(prefill_task));
    let decode_call = with_connect_retry(&ctx.state, Role::Decode, |lease| {
        decode_once(ctx, lease, &decode)
    });
    tokio::pin!(decode_call);
    let handle = prefill_task.0.as_mut().expect("set above");
    tokio::select! {
        prefilled = handle => {
            prefill_task.0 = None;
            match prefilled {
                Ok(Ok(())) => decode_call.await,
                Ok(Err(error)) => {
                    tracing::info!(%error, "push prefill failed; dropping the decode call");
                    Err(error)
                }
                Err(join) => Err(ProxyError::Config(format!("the prefill task ended: {join}"))),
            }
        }
        decoded = &mut decode_call => {
            if decoded.is_ok() {
                // Let the prefill finish on its own.
                if let Some(task) = prefill_task.0.take() {
                    tokio::spawn(async move {
                        if let Ok(Err(error)) = task.await {
                            tracing::warn!(%error, "push prefill failed after the decode instance answered");
                        }
                    });
                }
            }
            decoded
        }
    }
}

/// A task aborted when dropped (unless taken out).
struct AbortOnDrop<T>(Option<tokio::task::JoinHandle<T>>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// The host and port of a base URL, as a decode instance would address it.
fn host_port(url: &str) -> Option<(String, u16)> {
    let url = reqwest::Url::parse(url).ok()?;
    let host = url
        .host_str()?
        .trim_start_matches('[')
        .trim_end_matches(']');
    Some((host.to_string(), url.port_or_known_default()?))
}

/// Runs `attempt` on a leased instance of `role`; if it could not connect, takes that instance
/// out of rotation and runs `attempt` once more on another one (if there is one).
async fn with_connect_retry<T, F, Fut>(
    state: &ProxyState,
    role: Role,
    mut attempt: F,
) -> Result<T, ProxyError>
where
    F: FnMut(Lease) -> Fut,
    Fut: Future<Output = Result<T, ProxyError>>,
{
    let pool = state.pool(role);
    let lease = pool.acquire(None)?;
    let first = lease.instance().clone();
    let result = observe(role, &first, attempt(lease).await);
    let Err(error @ ProxyError::UpstreamConnect { .. }) = result else {
        return result;
    };
    let Ok(lease) = pool.acquire(Some(&first)) else {
        return Err(error);
    };
    tracing::info!(%role, failed = first.url(), next = lease.instance().url(), "retrying on another instance");
    telemetry::upstream_retried(role.as_str());
    let second = lease.instance().clone();
    observe(role, &second, attempt(lease).await)
}

/// Records how an upstream call ended; a failed connect takes the instance out of rotation.
fn observe<T>(
    role: Role,
    instance: &Instance,
    result: Result<T, ProxyError>,
) -> Result<T, ProxyError> {
    match &result {
        Ok(_) => telemetry::upstream_finished(role.as_str(), telemetry::OUTCOME_OK),
        Err(error) => {
            if matches!(error, ProxyError::UpstreamConnect { .. }) {
                instance.set_healthy(false);
            }
            tracing::debug!(%role, url = instance.url(), %error, "upstream call failed");
            telemetry::upstream_finished(role.as_str(), error.code());
        }
    }
    result
}

/// A POST of `body` to the route's path on the instance, with the request's id and the proxy's
/// upstream key.
fn post(ctx: &Ctx, instance: &Instance, body: &ClientBody) -> reqwest::RequestBuilder {
    let url = format!("{}{}", instance.url(), ctx.route.path());
    ctx.state
        .upstream(ctx.state.client().post(url))
        .header(X_REQUEST_ID, ctx.request_id.as_str())
        .json(body)
}

fn transport_error(instance: &Instance, source: reqwest::Error) -> ProxyError {
    let (role, url) = (instance.role(), instance.url().to_owned());
    if source.is_connect() {
        ProxyError::UpstreamConnect { role, url, source }
    } else {
        ProxyError::UpstreamTransport { role, url, source }
    }
}

fn timeout_error(instance: &Instance, after: Duration) -> ProxyError {
    ProxyError::UpstreamTimeout {
        role: instance.role(),
        url: instance.url().to_owned(),
        after,
    }
}

/// An upstream's non-2xx answer: its own OpenAI error (4xx/5xx) is passed through, anything else is 502.
fn error_status(instance: &Instance, status: StatusCode, body: Bytes) -> ProxyError {
    let (role, url) = (instance.role(), instance.url().to_owned());
    if (status.is_client_error() || status.is_server_error()) && is_openai_error(&body) {
        ProxyError::UpstreamErrorResponse {
            role,
            url,
            status,
            body,
        }
    } else {
        ProxyError::UpstreamStatus { role, url, status }
    }
}

/// Reads at most `MAX_ERROR_BODY_BYTES` of an upstream's body.
async fn read_capped(mut response: reqwest::Response) -> Result<Bytes, reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = MAX_ERROR_BODY_BYTES - body.len();
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if body.len() == MAX_ERROR_BODY_BYTES {
            break;
        }
    }
    Ok(body.into())
}

/// One prefill call: the whole exchange within `prefill_timeout`; returns the producer's base
/// URL and its params (`None`: its answer carries none, as in push mode).
async fn prefill_once(
    ctx: &Ctx,
    lease: Lease,
    body: &ClientBody,
) -> Result<(String, Option<Map<String, Value>>), ProxyError> {
    let instance = lease.instance().clone();
    let limit = ctx.state.settings().prefill_timeout;
    let exchange = async {
        let response = post(ctx, &instance, body)
            .send()
            .await
            .map_err(|e| transport_error(&instance, e))?;
        let status = response.status();
        let bytes = read_capped(response)
            .await
            .map_err(|e| transport_error(&instance, e))?;
        Ok::<_, ProxyError>((status, bytes))
    };
    let (status, bytes) = tokio::time::timeout(limit, exchange)
        .await
        .map_err(|_| timeout_error(&instance, limit))??;
    drop(lease);
    if !status.is_success() {
        return Err(error_status(&instance, status, bytes));
    }
    let params = match kv_transfer_params(&bytes) {
        Ok(params) => Some(params),
        Err(KvParamsError::Missing) => None,
        Err(KvParamsError::NotJson(reason)) => {
            return Err(ProxyError::InvalidUpstreamResponse {
                role: Role::Prefill,
                url: instance.url().to_owned(),
                reason,
            })
        }
    };
    Ok((instance.url().to_owned(), params))
}

/// One decode call: its head within `decode_first_byte_timeout`, then its body relayed.
async fn decode_once(ctx: &Ctx, lease: Lease, body: &ClientBody) -> Result<Response, ProxyError> {
    let instance = lease.instance().clone();
    let settings = ctx.state.settings();
    let limit = settings.decode_first_byte_timeout;
    let response = tokio::time::timeout(limit, post(ctx, &instance, body).send())
        .await
        .map_err(|_| timeout_error(&instance, limit))?
        .map_err(|e| transport_error(&instance, e))?;
    let status = response.status();
    if !status.is_success() {
        let idle = settings.decode_idle_timeout;
        let bytes = tokio::time::timeout(idle, read_capped(response))
            .await
            .map_err(|_| timeout_error(&instance, idle))?
            .map_err(|e| transport_error(&instance, e))?;
        return Err(error_status(&instance, status, bytes));
    }
    let sse = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
    let mut answer = Response::builder().status(status);
    for name in RELAYED_HEADERS {
        if let Some(value) = response.headers().get(&name) {
            answer = answer.header(name, value.clone());
        }
    }
    let in_flight = InFlight {
        _lease: lease,
        route: ctx.route.label(),
        request_id: ctx.request_id.clone(),
        started: ctx.started,
        sse,
        at_event_boundary: true,
        first_chunk_seen: false,
        finished: false,
    };
    let body = Body::from_stream(relay(
        Box::pin(response.bytes_stream()),
        in_flight,
        settings.decode_idle_timeout,
    ));
    Ok(answer
        .body(body)
        .expect("status and headers come from a valid upstream response"))
}

/// A decode answer being relayed: holds the decode lease and counts the request when it ends,
/// as `client_disconnected` if it is dropped before the upstream body ended.
struct InFlight {
    _lease: Lease,
    route: &'static str,
    request_id: String,
    started: Instant,
    /// The body is an SSE stream (it can be ended with an error event).
    sse: bool,
    /// The bytes relayed so far end with a complete SSE event (or nothing was relayed).
    at_event_boundary: bool,
    first_chunk_seen: bool,
    finished: bool,
}

impl InFlight {
    fn chunk(&mut self, chunk: &[u8]) {
        self.at_event_boundary = chunk.ends_with(b"\n\n") || chunk.ends_with(b"\r\n\r\n");
        if !self.first_chunk_seen {
            self.first_chunk_seen = true;
            telemetry::first_chunk_after(self.started.elapsed().as_secs_f64());
        }
    }

    fn finish(&mut self, outcome: &'static str) {
        self.finished = true;
        telemetry::request_finished(self.route, outcome);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if !self.finished {
            tracing::debug!(request_id = %self.request_id, "client went away; aborting the decode request");
            telemetry::request_finished(self.route, telemetry::OUTCOME_CLIENT_DISCONNECTED);
        }
    }
}

type UpstreamBody = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// Relays `upstream` chunk by chunk. An upstream error ends an SSE body with the mid-stream error
/// event and `[DONE]` (after a blank line if an event was left half-sent); it ends any other body
/// with an error, as does a silence longer than `idle` (the client's connection is cut, so it
/// sees a truncated answer).
fn relay(
    upstream: UpstreamBody,
    in_flight: InFlight,
    idle: Duration,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    futures::stream::unfold(Some((upstream, in_flight)), move |state| async move {
        let (mut upstream, mut in_flight) = state?;
        loop {
            match tokio::time::timeout(idle, upstream.next()).await {
                Ok(Some(Ok(chunk))) if chunk.is_empty() => continue,
                Ok(Some(Ok(chunk))) => {
                    in_flight.chunk(&chunk);
                    return Some((Ok(chunk), Some((upstream, in_flight))));
                }
                Ok(None) => {
                    in_flight.finish(telemetry::OUTCOME_OK);
                    return None;
                }
                Ok(Some(Err(e))) if in_flight.sse => {
                    tracing::warn!(request_id = %in_flight.request_id, error = %e, "decode instance failed mid-stream; ending the client's stream with an error event");
                    in_flight.finish(telemetry::OUTCOME_DECODE_FAILED_MID_STREAM);
                    let event = mid_stream_error_event();
                    let end = if in_flight.at_event_boundary {
                        event
                    } else {
                        Bytes::from([&b"\n\n"[..], &event].concat())
                    };
                    return Some((Ok(end), None));
                }
                Ok(Some(Err(e))) => {
                    tracing::warn!(request_id = %in_flight.request_id, error = %e, "decode body failed mid-stream");
                    in_flight.finish(telemetry::OUTCOME_STREAM_ERROR);
                    return Some((Err(std::io::Error::other(e)), None));
                }
                Err(_) => {
                    tracing::warn!(request_id = %in_flight.request_id, ?idle, "decode body idle for too long");
                    in_flight.finish(telemetry::OUTCOME_STREAM_ERROR);
                    return Some((
                        Err(std::io::Error::other("decode instance went silent")),
                        None,
                    ));
                }
            }
        }
    })
}

/// `GET /v1/models` on a decode instance, relayed as is.
async fn models_request(ctx: &Ctx) -> Result<Response, ProxyError> {
    let response =
        with_connect_retry(&ctx.state, Role::Decode, |lease| models_once(ctx, lease)).await?;
    telemetry::request_finished(ctx.route.label(), telemetry::OUTCOME_OK);
    Ok(response)
}

async fn models_once(ctx: &Ctx, lease: Lease) -> Result<Response, ProxyError> {
    let instance: Arc<Instance> = lease.instance().clone();
    let limit = ctx.state.settings().prefill_timeout;
    let exchange = async {
        let url = format!("{}{}", instance.url(), ctx.route.path());
        let response = ctx
            .state
            .upstream(ctx.state.client().get(url))
            .header(X_REQUEST_ID, ctx.request_id.as_str())
            .send()
            .await
            .map_err(|e| transport_error(&instance, e))?;
        let status = response.status();
        let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
        let bytes = read_capped(response)
            .await
            .map_err(|e| transport_error(&instance, e))?;
        Ok::<_, ProxyError>((status, content_type, bytes))
    };
    let (status, content_type, bytes) = tokio::time::timeout(limit, exchange)
        .await
        .map_err(|_| timeout_error(&instance, limit))??;
    if !status.is_success() {
        return Err(error_status(&instance, status, bytes));
    }
    let mut response = (status, bytes).into_response();
    if let Some(content_type) = content_type {
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, content_type);
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_id_keeps_a_sane_client_id_and_replaces_others() {
        let mut headers = HeaderMap::new();
        headers.insert(X_REQUEST_ID, HeaderValue::from_static("client-42"));
        assert_eq!(request_id(&headers), "client-42");
        headers.insert(X_REQUEST_ID, HeaderValue::from_static("has space"));
        assert_ne!(request_id(&headers), "has space");
        let long = "x".repeat(MAX_REQUEST_ID_LEN + 1);
        headers.insert(X_REQUEST_ID, HeaderValue::from_str(&long).unwrap());
        assert_eq!(request_id(&headers).len(), 36);
        assert_eq!(request_id(&HeaderMap::new()).len(), 36);
    }
}
