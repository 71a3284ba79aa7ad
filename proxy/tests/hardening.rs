//! The proxy's hardening over real HTTP: API keys (client side and upstream side), checks made
//! before any prefill, the early KV release after a failed decode, a decode instance dying
//! mid-stream, and the HTTP edge's connection limit on `serve_with`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

const CLIENT_KEY: &str = "sk-client-key";
const UPSTREAM_KEY: &str = "sk-upstream-key";

fn completion() -> Value {
    json!({"model": "m", "prompt": "Hi", "max_tokens": 5})
}

async fn post_with(
    proxy: &Proxy,
    path: &str,
    auth: Option<&str>,
    body: &Value,
) -> reqwest::Response {
    let mut request = client().post(format!("{}{path}", proxy.url)).json(body);
    if let Some(auth) = auth {
        request = request.header("authorization", auth);
    }
    request.send().await.unwrap()
}

fn auth_of(request: &Recorded) -> Option<&str> {
    request
        .headers
        .get("authorization")
        .map(|v| v.to_str().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_on_every_route_but_health_and_metrics() {
    let (p, d) = fakes().await;
    let mut config = args(&[&p.url], &[&d.url]);
    config.api_key = Some(CLIENT_KEY.parse().unwrap());
    let proxy = start_proxy(config, Some(prometheus())).await;

    for auth in [None, Some("Bearer sk-wrong"), Some(CLIENT_KEY)] {
        for path in ["/v1/completions", "/v1/chat/completions", "/v1/nope"] {
            let response = post_with(&proxy, path, auth, &completion()).await;
            assert_eq!(response.status(), 401, "{path} with {auth:?}");
            let body: Value = response.json().await.unwrap();
            assert_eq!(body["error"]["type"], "authentication_error");
            assert_envelope(&body, "invalid_api_key");
        }
        let models = client()
            .get(format!("{}/v1/models", proxy.url))
            .send()
            .await
            .unwrap();
        assert_eq!(models.status(), 401);
    }
    assert!(p.requests().is_empty() && d.requests().is_empty());

    for open in ["/health", "/metrics"] {
        let response = client()
            .get(format!("{}{open}", proxy.url))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{open} stays open");
    }

    let bearer = format!("Bearer {CLIENT_KEY}");
    let response = post_with(&proxy, "/v1/completions", Some(&bearer), &completion()).await;
    assert_eq!(response.status(), 200);
    // Without --upstream-api-key the proxy sends its --api-key upstream.
    assert_eq!(auth_of(&p.completions()[0]), Some(bearer.as_str()));
    assert_eq!(auth_of(&d.completions()[0]), Some(bearer.as_str()));
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_calls_carry_the_proxys_key_never_the_clients() {
    let (p, d) = fakes().await;
    let mut config = args(&[&p.url], &[&d.url]);
    config.upstream_api_key = Some(UPSTREAM_KEY.parse().unwrap());
    let proxy = start_proxy(config, None).await;
    const CLIENT_OWN: &str = "Bearer client-own-secret";
    let client_auth = Some(CLIENT_OWN);

    let response = post_with(&proxy, "/v1/completions", client_auth, &completion()).await;
    assert_eq!(response.status(), 200);
    let models = client()
        .get(format!("{}/v1/models", proxy.url))
        .header("authorization", CLIENT_OWN)
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    proxy.state.check_health_once().await;

    let expected = format!("Bearer {UPSTREAM_KEY}");
    let calls: Vec<Recorded> = p.requests().into_iter().chain(d.requests()).collect();
    let paths: Vec<&str> = calls.iter().map(|r| r.path.as_str()).collect();
    for path in ["/v1/completions", "/v1/models", "/health"] {
        assert!(paths.contains(&path), "{path} missing from {paths:?}");
    }
    for call in &calls {
        assert_eq!(auth_of(call), Some(expected.as_str()), "{}", call.path);
    }

    // No key configured: the client's header is dropped, not forwarded.
    let (p2, d2) = fakes().await;
    let open = start_proxy(args(&[&p2.url], &[&d2.url]), None).await;
    let response = post_with(&open, "/v1/completions", client_auth, &completion()).await;
    assert_eq!(response.status(), 200);
    for call in p2.requests().iter().chain(&d2.requests()) {
        assert_eq!(auth_of(call), None, "{}", call.path);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_healthy_decode_is_503_before_any_prefill() {
    let (p, d) = fakes().await;
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;
    d.set_healthy(false);
    proxy.state.check_health_once().await;
    assert!(!proxy.state.status().decode[0].healthy);

    let response = proxy
        .post(
            "/v1/chat/completions",
            &json!({"model": "m", "messages": []}),
        )
        .await;
    assert_eq!(response.status(), 503);
    let body: Value = response.json().await.unwrap();
    assert_envelope(&body, "no_healthy_instance");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("decode"));
    assert!(p.completions().is_empty(), "no prefill was made");
    assert!(p.releases().is_empty());
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_limits_below_one_or_not_integers_are_400_before_any_upstream_call() {
    let (p, d) = fakes().await;
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;
    for (body, field) in [
        (json!({"prompt": "Hi", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": "Hi", "max_tokens": -1}), "max_tokens"),
        (json!({"prompt": "Hi", "max_tokens": "5"}), "max_tokens"),
        (json!({"prompt": "Hi", "max_tokens": 2.5}), "max_tokens"),
        (
            json!({"messages": [], "max_completion_tokens": 0}),
            "max_completion_tokens",
        ),
    ] {
        let response = proxy.post("/v1/completions", &body).await;
        assert_eq!(response.status(), 400, "{body}");
        let envelope: Value = response.json().await.unwrap();
        assert_envelope(&envelope, "invalid_param");
        assert_eq!(envelope["error"]["param"], field, "{body}");
        assert!(envelope["error"]["message"]
            .as_str()
            .unwrap()
            .contains(field));
    }
    assert!(p.requests().is_empty() && d.requests().is_empty());
}

/// Sends one request whose decode call fails (the fake decode in `decode_mode`, or no decode
/// instance listening), and checks the status the
/// client gets and the KV release the producer receives.
async fn decode_failure_releases_the_blocks(
    decode_mode: Option<Mode>,
    dead_decode: bool,
    expected_status: u16,
) {
    let (p, d) = fakes().await;
    let decode_url = if dead_decode {
        dead_url().await
    } else {
        d.url.clone()
    };
    if let Some(mode) = decode_mode {
        d.set_mode(mode);
    }
    let mut config = args(&[&p.url], &[&decode_url]);
    config.decode_first_byte_timeout_secs = 0.3;
    config.upstream_api_key = Some(UPSTREAM_KEY.parse().unwrap());
    let proxy = start_proxy(config, None).await;

    let response = client()
        .post(format!("{}/v1/completions", proxy.url))
        .header("x-request-id", "req-release-1")
        .json(&completion())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), expected_status);
    wait_until("the producer gets the release", || p.releases().len() == 1).await;
    let release = &p.releases()[0];
    assert_eq!(
        release.body,
        json!({"kv_transfer_params": producer_params("p0")}),
        "the params the producer returned, untouched"
    );
    assert_eq!(release.headers["x-request-id"], "req-release-1");
    assert_eq!(
        auth_of(release),
        Some(format!("Bearer {UPSTREAM_KEY}").as_str())
    );
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_error_status_releases_the_producer_blocks() {
    let no_room = r#"{"error":{"message":"prompt leaves no room to decode","type":"BadRequestError","param":null,"code":400}}"#;
    decode_failure_releases_the_blocks(Some(Mode::Fail(400, no_room.into())), false, 400).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_decode_releases_the_producer_blocks() {
    decode_failure_releases_the_blocks(None, true, 502).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_timeout_releases_the_producer_blocks() {
    decode_failure_releases_the_blocks(Some(Mode::Hang), false, 504).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn successful_decode_releases_nothing() {
    let (p, d) = fakes().await;
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;
    let response = proxy.post("/v1/completions", &completion()).await;
    assert_eq!(response.status(), 200);
    response.text().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(p.releases().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_dying_mid_stream_ends_the_sse_with_an_error_event_then_done() {
    let (p, d) = fakes().await;
    d.set_mode(Mode::DieMidStream);
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), Some(prometheus())).await;
    let started = Instant::now();
    let response = proxy
        .post(
            "/v1/completions",
            &json!({"model": "m", "prompt": "Hi", "stream": true}),
        )
        .await;
    assert_eq!(response.status(), 200);
    let text = response
        .text()
        .await
        .expect("the client's stream ends cleanly, not cut");
    assert!(started.elapsed() < Duration::from_secs(3), "no hang");
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 4, "{text:?}");
    assert_eq!(format!("{}\n\n", events[0]), sse_chunk(0));
    assert_eq!(format!("{}\n\n", events[1]), sse_chunk(1));
    let error: Value = serde_json::from_str(events[2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(error["error"]["type"], "upstream_error");
    assert_eq!(error["error"]["code"], 502);
    assert!(error["error"].as_object().unwrap().contains_key("param"));
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("decode instance") && message.contains("failed mid-stream"));
    assert!(!message.contains("127.0.0.1"), "no upstream address leaks");
    assert_eq!(events[3], "data: [DONE]");
    proxy.assert_idle().await;

    let metrics = proxy.metrics_text().await;
    assert!(
        metrics.contains(
            r#"tandem:proxy_requests_total{route="completions",outcome="decode_failed_mid_stream"}"#
        ),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_decode_dying_mid_body_errors_the_client() {
    let (p, d) = fakes().await;
    d.set_mode(Mode::DieMidStream);
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;
    let response = proxy.post("/v1/completions", &completion()).await;
    assert_eq!(response.status(), 200, "the status was already relayed");
    assert!(
        response.text().await.is_err(),
        "the client sees a broken body, not a clean end"
    );
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_enforces_the_connection_limit_and_header_timeout() {
    let (p, d) = fakes().await;
    let mut config = args(&[&p.url], &[&d.url]);
    config.max_connections = 4;
    config.header_read_timeout_secs = 0.5;
    let state = tandem_proxy::ProxyState::new(config, None).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(tandem_proxy::serve_with(listener, state, async {
        stopped.await.ok();
    }));

    let mut idle = Vec::new();
    for _ in 0..12 {
        let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = socket.write_all(b"POST /v1/compl").await;
        idle.push(socket);
    }
    let started = Instant::now();
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut healthy = false;
    while started.elapsed() < Duration::from_secs(3) {
        if let Ok(r) = quick.get(format!("http://{addr}/health")).send().await {
            healthy = r.status() == 200;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        healthy,
        "/health answers once the idle sockets are timed out"
    );
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
