//! Test harness: fake prefill and decode instances (small axum servers on 127.0.0.1:0 that
//! record what they get and can be told to fail, hang or hold a stream), and the proxy on a
//! real socket.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::StreamExt;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{json, Value};
use tandem_proxy::{ProxyArgs, ProxyState};
use tokio::sync::Semaphore;

/// What a fake does with the next requests.
#[derive(Debug, Clone)]
pub enum Mode {
    /// Prefill: answer with kv_transfer_params. Decode: answer (SSE in 3 chunks, or JSON).
    Normal,
    /// Answer this status and body (as JSON content type).
    Fail(u16, String),
    /// Never answer.
    Hang,
    /// Prefill: answer without kv_transfer_params.
    NoKvParams,
    /// Decode, streaming: send the first chunk, then wait for `release` before the rest.
    Held,
    /// Decode, streaming: a chunk every 20 ms, 500 of them.
    Endless,
    /// Decode: two SSE chunks (streaming) or half a JSON body (not streaming), then the
    /// connection is dropped, as when the instance dies.
    DieMidStream,
}

/// One request a fake received.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
}

pub struct FakeState {
    pub name: String,
    pub requests: Mutex<Vec<Recorded>>,
    pub healthy: AtomicBool,
    pub mode: Mutex<Mode>,
    gate: Semaphore,
    /// Streams whose body was dropped before the last chunk (the client side went away).
    pub streams_cut: AtomicUsize,
    /// Streams that sent their last chunk.
    pub streams_completed: AtomicUsize,
}

pub struct Fake {
    pub url: String,
    pub state: Arc<FakeState>,
}

impl Fake {
    pub fn set_mode(&self, mode: Mode) {
        *self.state.mode.lock().unwrap() = mode;
    }
    pub fn set_healthy(&self, healthy: bool) {
        self.state.healthy.store(healthy, Ordering::SeqCst);
    }
    /// Lets `n` held streams go on.
    pub fn release(&self, n: usize) {
        self.state.gate.add_permits(n);
    }
    pub fn requests(&self) -> Vec<Recorded> {
        self.state.requests.lock().unwrap().clone()
    }
    pub fn completions(&self) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.path != "/health" && r.path != tandem_proxy::RELEASE_PATH)
            .collect()
    }
    /// The KV releases a fake prefill received.
    pub fn releases(&self) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.path == tandem_proxy::RELEASE_PATH)
            .collect()
    }
}

/// The kv_transfer_params every fake prefill returns, with keys the proxy does not know.
pub fn producer_params(name: &str) -> Value {
    json!({
        "do_remote_prefill": true,
        "remote_engine_id": name,
        "remote_request_id": "remote-1",
        "remote_block_ids": [3, 1, 4],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "kv_checksums": "lAEBAZGVAAAQAMQIAAAAAAAAAAA=",
        "x_future_key": {"nested": [1, null, "two"]},
    })
}

pub async fn fake_prefill(name: &str) -> Fake {
    start_fake(name, post(prefill_handler)).await
}

/// One fake prefill instance (`p0`) and one fake decode instance (`d0`).
pub async fn fakes() -> (Fake, Fake) {
    (fake_prefill("p0").await, fake_decode("d0").await)
}

pub async fn fake_decode(name: &str) -> Fake {
    start_fake(name, post(decode_handler)).await
}

async fn start_fake(name: &str, completion: axum::routing::MethodRouter<Arc<FakeState>>) -> Fake {
    let state = Arc::new(FakeState {
        name: name.to_owned(),
        requests: Mutex::new(Vec::new()),
        healthy: AtomicBool::new(true),
        mode: Mutex::new(Mode::Normal),
        gate: Semaphore::new(0),
        streams_cut: AtomicUsize::new(0),
        streams_completed: AtomicUsize::new(0),
    });
    let app = Router::new()
        .route("/v1/completions", completion.clone())
        .route("/v1/chat/completions", completion)
        .route("/v1/models", get(models_handler))
        .route("/health", get(health_handler))
        .route(tandem_proxy::RELEASE_PATH, post(release_handler))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Fake {
        url: format!("http://{addr}"),
        state,
    }
}

fn record(state: &FakeState, path: &str, headers: &HeaderMap, body: Value) {
    state.requests.lock().unwrap().push(Recorded {
        path: path.to_owned(),
        headers: headers.clone(),
        body,
    });
}

async fn health_handler(State(state): State<Arc<FakeState>>, headers: HeaderMap) -> StatusCode {
    record(&state, "/health", &headers, Value::Null);
    if state.healthy.load(Ordering::SeqCst) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn release_handler(
    State(state): State<Arc<FakeState>>,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let body: Value = serde_json::from_slice(&body).expect("the proxy sends JSON");
    record(&state, tandem_proxy::RELEASE_PATH, &headers, body);
    StatusCode::OK
}

async fn models_handler(State(state): State<Arc<FakeState>>, headers: HeaderMap) -> Response {
    record(&state, "/v1/models", &headers, Value::Null);
    axum::Json(json!({"object": "list", "data": [{"id": "fake-model", "owned_by": state.name}]}))
        .into_response()
}

fn fail(status: u16, body: String) -> Response {
    (
        StatusCode::from_u16(status).unwrap(),
        [("content-type", "application/json")],
        body,
    )
        .into_response()
}

async fn prefill_handler(
    State(state): State<Arc<FakeState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).expect("the proxy sends JSON");
    record(&state, uri.path(), &headers, body);
    let mode = state.mode.lock().unwrap().clone();
    let mut answer = json!({
        "id": "cmpl-prefill",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
    });
    match mode {
        Mode::Fail(status, body) => return fail(status, body),
        Mode::Hang => {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        Mode::NoKvParams => {}
        _ => answer["kv_transfer_params"] = producer_params(&state.name),
    }
    axum::Json(answer).into_response()
}

/// Counts a stream as cut if it is dropped before its last chunk.
struct StreamGuard {
    state: Arc<FakeState>,
    completed: bool,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if self.completed {
            self.state.streams_completed.fetch_add(1, Ordering::SeqCst);
        } else {
            self.state.streams_cut.fetch_add(1, Ordering::SeqCst);
        }
    }
}

pub fn sse_chunk(i: usize) -> String {
    format!("data: {{\"choices\":[{{\"index\":0,\"text\":\"tok{i}\"}}]}}\n\n")
}

async fn decode_handler(
    State(state): State<Arc<FakeState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).expect("the proxy sends JSON");
    let stream = body["stream"] == json!(true);
    record(&state, uri.path(), &headers, body);
    let mode = state.mode.lock().unwrap().clone();
    match mode {
        Mode::Fail(status, body) => return fail(status, body),
        Mode::Hang => {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        _ => {}
    }
    if matches!(mode, Mode::DieMidStream) {
        let (content_type, parts) = if stream {
            ("text/event-stream", vec![sse_chunk(0), sse_chunk(1)])
        } else {
            (
                "application/json",
                vec![r#"{"id":"cmpl-decode","choices":["#.to_owned()],
            )
        };
        let chunks = futures::stream::iter(parts.into_iter().map(Ok::<_, std::io::Error>)).chain(
            futures::stream::once(async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Err(std::io::Error::other("decode instance died"))
            }),
        );
        return ([("content-type", content_type)], Body::from_stream(chunks)).into_response();
    }
    if !stream {
        return axum::Json(json!({
            "id": "cmpl-decode",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "hello world", "finish_reason": "length"}],
            "served_by": state.name,
        }))
        .into_response();
    }
    let (count, delay) = match mode {
        Mode::Endless => (500, Duration::from_millis(20)),
        _ => (3, Duration::from_millis(10)),
    };
    let held = matches!(mode, Mode::Held);
    let guard = StreamGuard {
        state: state.clone(),
        completed: false,
    };
    let chunks = futures::stream::unfold((0usize, guard), move |(i, mut guard)| async move {
        if i > count {
            return None;
        }
        if i == 1 && held {
            guard.state.gate.acquire().await.unwrap().forget();
        } else if i > 0 {
            tokio::time::sleep(delay).await;
        }
        let chunk = if i == count {
            guard.completed = true;
            "data: [DONE]\n\n".to_owned()
        } else {
            sse_chunk(i)
        };
        Some((Ok::<_, std::io::Error>(chunk), (i + 1, guard)))
    });
    (
        [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
        ],
        Body::from_stream(chunks),
    )
        .into_response()
}

/// A port on 127.0.0.1 where nothing listens.
pub async fn dead_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}")
}

/// Proxy settings for tests: short timeouts.
pub fn args(prefill: &[&str], decode: &[&str]) -> ProxyArgs {
    ProxyArgs {
        host: "127.0.0.1".into(),
        port: 0,
        prefill: prefill.iter().map(|s| s.to_string()).collect(),
        decode: decode.iter().map(|s| s.to_string()).collect(),
        connect_timeout_secs: 1.0,
        prefill_timeout_secs: 5.0,
        decode_first_byte_timeout_secs: 5.0,
        decode_idle_timeout_secs: 5.0,
        health_check_interval_secs: 0.1,
        health_check_timeout_secs: 0.5,
        ..ProxyArgs::default()
    }
}

pub struct Proxy {
    pub url: String,
    pub state: ProxyState,
    pub addr: SocketAddr,
}

/// Runs the proxy's app on a real socket through the HTTP edge with the args' limits (no health
/// checks unless the test starts them).
pub async fn start_proxy(args: ProxyArgs, prometheus: Option<PrometheusHandle>) -> Proxy {
    let limits =
        tandem_http_edge::EdgeLimits::new(args.max_connections, args.header_read_timeout_secs)
            .unwrap();
    let state = ProxyState::new(args, prometheus).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = tandem_proxy::app(state.clone());
    tokio::spawn(async move {
        tandem_http_edge::serve(listener, app, limits, std::future::pending())
            .await
            .unwrap()
    });
    Proxy {
        url: format!("http://{addr}"),
        state,
        addr,
    }
}

impl Proxy {
    /// `POST path` with a JSON body, from a fresh client.
    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        client()
            .post(format!("{}{path}", self.url))
            .json(body)
            .send()
            .await
            .unwrap()
    }

    /// The proxy's `/metrics` text.
    pub async fn metrics_text(&self) -> String {
        client()
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Waits until no request is in flight on any instance; fails the test after 5 s.
    pub async fn assert_idle(&self) {
        wait_until("every outstanding counter back to zero", || {
            let status = self.state.status();
            status
                .prefill
                .iter()
                .chain(&status.decode)
                .all(|i| i.outstanding == 0)
        })
        .await;
    }
}

/// Polls `cond` every 10 ms; panics with `what` after 5 s.
pub async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// Asserts an OpenAI error envelope with this `code`.
pub fn assert_envelope(body: &Value, code: &str) {
    let error = body["error"]
        .as_object()
        .unwrap_or_else(|| panic!("not an envelope: {body}"));
    assert!(error["message"].is_string(), "{body}");
    assert!(error["type"].is_string(), "{body}");
    assert!(error.contains_key("param"), "{body}");
    assert_eq!(error["code"], json!(code), "{body}");
}

/// The process-wide Prometheus recorder of this test binary.
pub fn prometheus() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| tandem_proxy::telemetry::install_prometheus_recorder().unwrap())
        .clone()
}
