//! The proxy over real HTTP: fake prefill and decode instances on 127.0.0.1, the proxy's app on
//! a real socket, reqwest as the client.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn chat(stream: bool) -> Value {
    json!({
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 20,
        "stream": stream,
        "stream_options": {"include_usage": true},
        "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "10.6.6.6", "remote_block_ids": [0]},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_gets_one_token_copy_and_decode_gets_producer_params() {
    let (p, d) = fakes().await;
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;

    let response = client()
        .post(format!("{}/v1/chat/completions", proxy.url))
        .header("x-request-id", "client-req-7")
        .json(&chat(true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-request-id"], "client-req-7");
    response.text().await.unwrap();

    let prefill = p.completions();
    assert_eq!(prefill.len(), 1);
    assert_eq!(prefill[0].path, "/v1/chat/completions");
    let mut expected_prefill = chat(true);
    let obj = expected_prefill.as_object_mut().unwrap();
    obj.remove("stream_options");
    obj.insert("max_tokens".into(), json!(1));
    obj.insert("stream".into(), json!(false));
    // The client's output limit rides along, for the producer to check the prompt against.
    obj.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "decode_max_tokens": 20}),
    );
    assert_eq!(prefill[0].body, expected_prefill);

    let decode = d.completions();
    assert_eq!(decode.len(), 1);
    let mut expected_decode = chat(true);
    expected_decode["kv_transfer_params"] = producer_params("p0");
    assert_eq!(
        decode[0].body, expected_decode,
        "the client's body plus the producer's params, untouched"
    );

    assert_eq!(prefill[0].headers["x-request-id"], "client-req-7");
    assert_eq!(decode[0].headers["x-request-id"], "client-req-7");
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_completion_returns_decode_json_with_one_generated_request_id() {
    let (p, d) = fakes().await;
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;

    let response = proxy.post("/v1/completions", &json!({"model": "m", "prompt": "Hello", "max_tokens": 5, "max_completion_tokens": 5, "n": 2})).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/json"));
    let id = response.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["served_by"], "d0");
    assert_eq!(body["choices"][0]["text"], "hello world");

    let (prefill, decode) = (p.completions(), d.completions());
    assert_eq!(prefill[0].path, "/v1/completions");
    assert_eq!(prefill[0].body["max_completion_tokens"], 1);
    assert_eq!(prefill[0].body["n"], 1);
    assert_eq!(decode[0].body["n"], 2);
    assert_eq!(decode[0].body["max_tokens"], 5);
    assert_eq!(id.len(), 36, "a UUID: {id}");
    assert_eq!(prefill[0].headers["x-request-id"], id.as_str());
    assert_eq!(decode[0].headers["x-request-id"], id.as_str());
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_relays_the_first_chunk_while_the_upstream_holds_the_rest() {
    let (p, d) = fakes().await;
    d.set_mode(Mode::Held);
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;

    let mut response = proxy.post("/v1/chat/completions", &chat(true)).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let first = tokio::time::timeout(Duration::from_secs(3), response.chunk())
        .await
        .expect("the first chunk must arrive while the upstream holds the rest")
        .unwrap()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&first), sse_chunk(0));
    assert_eq!(proxy.state.status().decode[0].outstanding, 1);
    assert_eq!(
        d.state
            .streams_completed
            .load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the upstream has not finished"
    );

    d.release(1);
    let mut rest = Vec::new();
    while let Some(chunk) = response.chunk().await.unwrap() {
        rest.extend_from_slice(&chunk);
    }
    let rest = String::from_utf8(rest).unwrap();
    assert_eq!(
        rest,
        format!("{}{}data: [DONE]\n\n", sse_chunk(1), sse_chunk(2))
    );
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_that_is_not_a_json_object_is_400_and_reaches_no_upstream() {
    let (p, d) = fakes().await;
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;
    for body in ["{not json", "[1, 2]", ""] {
        let response = client()
            .post(format!("{}/v1/completions", proxy.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "body {body:?}");
        assert_envelope(&response.json().await.unwrap(), "invalid_body");
    }
    assert!(p.completions().is_empty());
    assert!(d.completions().is_empty());
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_style_form_content_type_is_accepted() {
    let (p, d) = fakes().await;
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;
    let response = client()
        .post(format!("{}/v1/completions", proxy.url))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(r#"{"model":"m","prompt":"Hi"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(d.completions().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_prefill_is_502_then_503_once_taken_out() {
    let d = fake_decode("d0").await;
    let dead = dead_url().await;
    let proxy = start_proxy(args(&[&dead], &[&d.url]), None).await;
    let url = format!("{}/v1/completions", proxy.url);
    let body = json!({"model": "m", "prompt": "Hi"});

    let first = client().post(&url).json(&body).send().await.unwrap();
    assert_eq!(first.status(), 502);
    let first: Value = first.json().await.unwrap();
    assert_envelope(&first, "upstream_unreachable");
    assert!(
        !first.to_string().contains(&dead),
        "no upstream URL leaks to the client"
    );

    let second = client().post(&url).json(&body).send().await.unwrap();
    assert_eq!(second.status(), 503);
    assert_envelope(&second.json().await.unwrap(), "no_healthy_instance");

    let health = client()
        .get(format!("{}/health", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 503);
    let health: Value = health.json().await.unwrap();
    assert_envelope(&health, "no_healthy_instance");
    assert_eq!(health["prefill"][0]["healthy"], false);
    assert!(d.completions().is_empty());
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_prefill_connect_is_retried_on_another_instance() {
    let (p, d) = (fake_prefill("p-live").await, fake_decode("d0").await);
    let dead = dead_url().await;
    let proxy = start_proxy(args(&[&dead, &p.url], &[&d.url]), None).await;
    for _ in 0..3 {
        let response = proxy
            .post("/v1/completions", &json!({"model": "m", "prompt": "Hi"}))
            .await;
        assert_eq!(response.status(), 200);
    }
    assert_eq!(p.completions().len(), 3);
    for request in d.completions() {
        assert_eq!(
            request.body["kv_transfer_params"]["remote_engine_id"],
            "p-live"
        );
    }
    let status = proxy.state.status();
    assert!(!status.prefill[0].healthy, "the dead instance is out");
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_that_does_not_answer_in_time_is_504() {
    let (p, d) = fakes().await;
    p.set_mode(Mode::Hang);
    let mut config = args(&[&p.url], &[&d.url]);
    config.prefill_timeout_secs = 0.3;
    let proxy = start_proxy(config, None).await;
    let started = Instant::now();
    let response = proxy
        .post("/v1/completions", &json!({"model": "m", "prompt": "Hi"}))
        .await;
    assert_eq!(response.status(), 504);
    assert_envelope(&response.json().await.unwrap(), "upstream_timeout");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(d.completions().is_empty());
    assert!(
        proxy.state.status().prefill[0].healthy,
        "a slow instance is not taken out"
    );
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_answer_without_kv_transfer_params_is_502() {
    let (p, d) = fakes().await;
    p.set_mode(Mode::NoKvParams);
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;
    let response = proxy
        .post("/v1/completions", &json!({"model": "m", "prompt": "Hi"}))
        .await;
    assert_eq!(response.status(), 502);
    assert_envelope(
        &response.json().await.unwrap(),
        "missing_kv_transfer_params",
    );
    assert!(d.completions().is_empty());
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_openai_error_passes_through() {
    let (p, d) = fakes().await;
    let upstream = r#"{"error":{"message":"prompt too long","type":"invalid_request_error","param":"prompt","code":"context_length_exceeded"}}"#;
    p.set_mode(Mode::Fail(400, upstream.into()));
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;
    let response = proxy
        .post("/v1/completions", &json!({"model": "m", "prompt": "Hi"}))
        .await;
    assert_eq!(response.status(), 400);
    assert_eq!(response.text().await.unwrap(), upstream);
    assert!(d.completions().is_empty());
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_openai_error_passes_through_with_its_status() {
    let (p, d) = fakes().await;
    let upstream = r#"{"error":{"message":"KV load failed","type":"server_error","param":null,"code":"kv_load_failed"}}"#;
    d.set_mode(Mode::Fail(500, upstream.into()));
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;
    let response = proxy.post("/v1/chat/completions", &chat(true)).await;
    assert_eq!(response.status(), 500);
    assert_eq!(response.headers()["content-type"], "application/json");
    assert_eq!(response.text().await.unwrap(), upstream);
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_error_without_an_envelope_is_502() {
    let (p, d) = fakes().await;
    d.set_mode(Mode::Fail(500, "Internal Server Error".into()));
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;
    let response = proxy
        .post("/v1/completions", &json!({"model": "m", "prompt": "Hi"}))
        .await;
    assert_eq!(response.status(), 502);
    assert_envelope(&response.json().await.unwrap(), "upstream_bad_status");
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_that_does_not_answer_in_time_is_504() {
    let (p, d) = fakes().await;
    d.set_mode(Mode::Hang);
    let mut config = args(&[&p.url], &[&d.url]);
    config.decode_first_byte_timeout_secs = 0.3;
    let proxy = start_proxy(config, None).await;
    let response = proxy
        .post("/v1/completions", &json!({"model": "m", "prompt": "Hi"}))
        .await;
    assert_eq!(response.status(), 504);
    assert_envelope(&response.json().await.unwrap(), "upstream_timeout");
    proxy.assert_idle().await;
}

/// Which decode fake served each of `n` quick non-streaming requests.
async fn quick_requests(proxy: &Proxy, n: usize) -> Vec<String> {
    let mut served = Vec::new();
    for _ in 0..n {
        let body: Value = proxy
            .post("/v1/completions", &json!({"model": "m", "prompt": "Hi"}))
            .await
            .json()
            .await
            .unwrap();
        served.push(body["served_by"].as_str().unwrap().to_owned());
    }
    served
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_instance_with_fewer_outstanding_requests_is_picked() {
    let p = fake_prefill("p0").await;
    let (d0, d1) = (fake_decode("d0").await, fake_decode("d1").await);
    d0.set_mode(Mode::Held);
    d1.set_mode(Mode::Held);
    let proxy = start_proxy(args(&[&p.url], &[&d0.url, &d1.url]), None).await;

    // Both idle: ties alternate.
    let served = quick_requests(&proxy, 4).await;
    assert_eq!(
        served.iter().filter(|s| *s == "d0").count(),
        2,
        "{served:?}"
    );
    assert_eq!(
        served.iter().filter(|s| *s == "d1").count(),
        2,
        "{served:?}"
    );

    // One stream held open on one instance: every other request goes to the other one.
    let mut held = proxy
        .post(
            "/v1/completions",
            &json!({"model": "m", "prompt": "Hi", "stream": true}),
        )
        .await;
    held.chunk().await.unwrap().unwrap();
    let status = proxy.state.status();
    let busy = if status.decode[0].outstanding == 1 {
        "d0"
    } else {
        "d1"
    };
    assert_eq!(
        status.decode.iter().map(|i| i.outstanding).sum::<usize>(),
        1
    );
    let served = quick_requests(&proxy, 4).await;
    assert!(
        served.iter().all(|s| s != busy),
        "{busy} is busy, yet {served:?}"
    );

    d0.release(1);
    d1.release(1);
    while held.chunk().await.unwrap().is_some() {}
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_take_an_instance_out_and_bring_it_back() {
    let p = fake_prefill("p0").await;
    let (d0, d1) = (fake_decode("d0").await, fake_decode("d1").await);
    let proxy = start_proxy(args(&[&p.url], &[&d0.url, &d1.url]), None).await;
    let checks = proxy.state.spawn_health_checks();

    d1.set_healthy(false);
    wait_until("d1 out", || !proxy.state.status().decode[1].healthy).await;
    let served = quick_requests(&proxy, 4).await;
    assert!(served.iter().all(|s| s == "d0"), "{served:?}");
    let health: Value = client()
        .get(format!("{}/health", proxy.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["status"], "ok");
    assert_eq!(health["decode"][1]["healthy"], false);

    d0.set_healthy(false);
    wait_until("d0 out", || !proxy.state.status().decode[0].healthy).await;
    let response = proxy
        .post("/v1/completions", &json!({"model": "m", "prompt": "Hi"}))
        .await;
    assert_eq!(response.status(), 503);
    assert_envelope(&response.json().await.unwrap(), "no_healthy_instance");

    d0.set_healthy(true);
    d1.set_healthy(true);
    wait_until("both back", || {
        proxy.state.status().decode.iter().all(|i| i.healthy)
    })
    .await;
    let served = quick_requests(&proxy, 4).await;
    assert_eq!(
        served.iter().filter(|s| *s == "d1").count(),
        2,
        "{served:?}"
    );
    checks.abort();
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_closes_the_decode_connection() {
    let (p, d) = fakes().await;
    d.set_mode(Mode::Endless);
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), Some(prometheus())).await;

    let mut response = proxy.post("/v1/chat/completions", &chat(true)).await;
    assert_eq!(response.status(), 200);
    response.chunk().await.unwrap().unwrap();
    assert_eq!(proxy.state.status().decode[0].outstanding, 1);
    drop(response);

    use std::sync::atomic::Ordering::SeqCst;
    wait_until("the decode fake sees its stream cut", || {
        d.state.streams_cut.load(SeqCst) == 1
    })
    .await;
    assert_eq!(d.state.streams_completed.load(SeqCst), 0);
    proxy.assert_idle().await;
    let metrics = proxy.metrics_text().await;
    assert!(
        metrics.contains(
            r#"tandem:proxy_requests_total{route="chat_completions",outcome="client_disconnected"}"#
        ),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_that_goes_silent_mid_stream_is_cut() {
    let (p, d) = fakes().await;
    d.set_mode(Mode::Held);
    let mut config = args(&[&p.url], &[&d.url]);
    config.decode_idle_timeout_secs = 0.3;
    let proxy = start_proxy(config, None).await;
    let mut response = proxy
        .post(
            "/v1/completions",
            &json!({"model": "m", "prompt": "Hi", "stream": true}),
        )
        .await;
    response.chunk().await.unwrap().unwrap();
    let rest = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            match response.chunk().await {
                Ok(Some(_)) => continue,
                other => return other.map(|_| ()),
            }
        }
    })
    .await
    .expect("the proxy cuts a silent stream");
    assert!(
        rest.is_err(),
        "the client sees a truncated body, not a clean end"
    );
    use std::sync::atomic::Ordering::SeqCst;
    wait_until("the decode fake sees its stream cut", || {
        d.state.streams_cut.load(SeqCst) == 1
    })
    .await;
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_come_from_a_decode_instance() {
    let (p, d) = fakes().await;
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;
    let response = client()
        .get(format!("{}/v1/models", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["data"][0]["owned_by"], "d0");
    assert_eq!(d.completions()[0].path, "/v1/models");
    assert!(p.completions().is_empty());
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_and_outstanding_returns_to_zero() {
    let (p, d) = fakes().await;
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), Some(prometheus())).await;
    let response = proxy
        .post(
            "/v1/completions",
            &json!({"model": "m", "prompt": "Hi", "stream": true}),
        )
        .await;
    response.text().await.unwrap();
    proxy.assert_idle().await;
    let metrics = proxy.metrics_text().await;
    for line in [
        format!(
            r#"tandem:proxy_upstream_outstanding{{role="decode",instance="{}"}} 0"#,
            d.url
        ),
        format!(
            r#"tandem:proxy_upstream_outstanding{{role="prefill",instance="{}"}} 0"#,
            p.url
        ),
        format!(
            r#"tandem:proxy_upstream_healthy{{role="decode",instance="{}"}} 1"#,
            d.url
        ),
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "missing {line:?} in\n{metrics}"
        );
    }
    for name in [
        r#"tandem:proxy_requests_total{route="completions",outcome="ok"}"#,
        r#"tandem:proxy_upstream_requests_total{role="prefill",outcome="ok"}"#,
        r#"tandem:proxy_upstream_requests_total{role="decode",outcome="ok"}"#,
        "tandem:proxy_prefill_duration_seconds_bucket",
        "tandem:proxy_time_to_first_chunk_seconds_count",
    ] {
        assert!(metrics.contains(name), "missing {name} in\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_and_methods_answer_envelopes() {
    let (p, d) = fakes().await;
    let proxy = start_proxy(args(&[&p.url], &[&d.url]), None).await;
    let response = client()
        .get(format!("{}/v1/nope", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    assert_envelope(&response.json().await.unwrap(), "not_found");
    let response = client()
        .get(format!("{}/v1/completions", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 405);
    assert_envelope(&response.json().await.unwrap(), "method_not_allowed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn app_works_without_a_socket_via_oneshot() {
    use tower::ServiceExt;
    let state =
        tandem_proxy::ProxyState::new(args(&["http://127.0.0.1:9"], &["http://127.0.0.1:9"]), None)
            .unwrap();
    let request = axum::http::Request::post("/v1/completions")
        .body(axum::body::Body::from("nope"))
        .unwrap();
    let response = tandem_proxy::app(state).oneshot(request).await.unwrap();
    assert_eq!(response.status(), 400);
    assert!(response.headers().contains_key("x-request-id"));
}

#[test]
fn proxy_args_read_from_toml() {
    let args: tandem_proxy::ProxyArgs = toml::from_str(
        r#"
        port = 9000
        prefill = ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
        decode = ["http://127.0.0.1:8200"]
        prefill_timeout_secs = 30
        decode_idle_timeout_secs = 2.5
        "#,
    )
    .unwrap();
    assert_eq!(args.port, 9000);
    assert_eq!(args.host, "0.0.0.0");
    assert_eq!(args.prefill.len(), 2);
    assert_eq!(args.prefill_timeout_secs, 30.0);
    assert_eq!(args.decode_idle_timeout_secs, 2.5);
    assert!(
        toml::from_str::<tandem_proxy::ProxyArgs>("prefil = []").is_err(),
        "typos are rejected"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_over_the_limit_is_413() {
    let (p, d) = fakes().await;
    let mut config = args(&[&p.url], &[&d.url]);
    config.max_body_bytes = 64;
    let proxy = start_proxy(config, None).await;
    let response = proxy
        .post(
            "/v1/completions",
            &json!({"model": "m", "prompt": "x".repeat(100)}),
        )
        .await;
    assert_eq!(response.status(), 413);
    assert_envelope(&response.json().await.unwrap(), "body_too_large");
    assert!(p.completions().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gone_during_prefill_releases_the_prefill_instance() {
    let (p, d) = fakes().await;
    p.set_mode(Mode::Hang);
    let mut config = args(&[&p.url], &[&d.url]);
    config.prefill_timeout_secs = 60.0;
    let proxy = start_proxy(config, None).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let result = impatient
        .post(format!("{}/v1/completions", proxy.url))
        .json(&json!({"model": "m", "prompt": "Hi"}))
        .send()
        .await;
    assert!(result.is_err(), "the client gave up");
    assert_eq!(p.completions().len(), 1);
    // Well before the 60 s prefill timeout: the cancelled handler dropped its lease.
    proxy.assert_idle().await;
    assert!(d.completions().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_runs_health_checks_and_stops_on_shutdown() {
    let (p, d) = fakes().await;
    d.set_healthy(false);
    let state = tandem_proxy::ProxyState::new(args(&[&p.url], &[&d.url]), None).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(tandem_proxy::serve_with(listener, state.clone(), async {
        stopped.await.ok();
    }));
    wait_until("the health checks take d0 out", || {
        !state.status().decode[0].healthy
    })
    .await;
    let health = client().get(format!("{url}/health")).send().await.unwrap();
    assert_eq!(health.status(), 503);
    d.set_healthy(true);
    wait_until("d0 back", || state.status().decode[0].healthy).await;
    let health = client().get(format!("{url}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);

    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("serve_with returns after shutdown")
        .unwrap()
        .unwrap();
    assert!(
        client().get(format!("{url}/health")).send().await.is_err(),
        "no longer listening"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolved_replicas_and_the_dashboard() {
    let (p, d) = fakes().await;
    // The decode instance named by host name: the health round resolves it to its address.
    let port = d.url.rsplit(':').next().unwrap().to_owned();
    let mut a = args(&[&p.url], &[&format!("http://localhost:{port}")]);
    a.resolve_replicas = true;
    a.api_key = Some("sk-dashboard".parse().unwrap());
    let proxy = start_proxy(a, Some(prometheus())).await;
    proxy.state.check_health_once().await;
    let status = proxy.state.status();
    let resolved = format!("http://127.0.0.1:{port}");
    assert!(
        status.decode.iter().any(|i| i.url == resolved && i.healthy),
        "{status:?}"
    );
    assert!(status.decode.iter().all(|i| !i.url.contains("localhost")));
    assert!(status.is_ready());

    // The page and its summary are open like /metrics, the page allows nothing external.
    let page = client()
        .get(format!("{}/dashboard", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let csp = page.headers()["content-security-policy"].to_str().unwrap();
    assert!(csp.starts_with("default-src 'none'"), "{csp}");
    assert!(page.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let summary: Value = client()
        .get(format!("{}/dashboard/summary", proxy.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let instances = summary["instances"].as_array().unwrap();
    assert_eq!(instances.len(), 1 + status.decode.len(), "{summary}");
    assert_eq!(instances[0]["role"], "prefill");
    assert_eq!(instances[0]["url"], p.url.as_str());
    // The fakes have no /metrics: reported, not fatal.
    assert!(instances.iter().all(|i| i["scraped"] == false), "{summary}");
    assert!(summary["proxy"]["requests_ok"].is_number(), "{summary}");
    // Other routes still need the key.
    let models = client()
        .get(format!("{}/v1/models", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 401);
}
