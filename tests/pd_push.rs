//! Push mode end to end: real `tandem serve` producer and consumer processes with
//! `NixlPushConnector`, real NIXL WRITEs, the real default model, behind `tandem proxy --kv-mode
//! push`. The checksums travel on the WRITE's completion notification (the connector-owned
//! carrier); every fault is caught and handled by `kv_load_failure_policy`; nothing leaks.

mod common;

use std::time::Duration;

use common::{greedy_ids, ids, post, stream_text, Server};
use serde_json::{json, Value};

fn producer_cfg(fault: Option<&str>) -> String {
    let extra = fault
        .map(|k| {
            format!(
                r#","kv_connector_extra_config":{{"transport_fault_injection":{{"kind":"{k}","seed":3}}}}"#
            )
        })
        .unwrap_or_default();
    format!(
        r#"{{"kv_connector":"NixlPushConnector","kv_role":"kv_producer","enable_kv_checksum":true{extra}}}"#
    )
}

fn consumer_cfg(policy: &str, load_timeout: f64, engine_fault: Option<&str>) -> String {
    let fault = engine_fault
        .map(|k| format!(r#","kv_fault_injection":{{"kind":"{k}","probability":1.0,"seed":7}}"#))
        .unwrap_or_default();
    format!(
        r#"{{"kv_connector":"NixlPushConnector","kv_role":"kv_consumer","enable_kv_checksum":true,"kv_checksum_fail_closed":true,"kv_load_failure_policy":"{policy}","kv_connector_extra_config":{{"load_timeout":{load_timeout}}}{fault}}}"#
    )
}

struct Push {
    prefill: Server,
    decode: Server,
    proxy: Server,
}

fn deploy(producer: &str, consumer: &str) -> Push {
    common::require_model();
    let prefill = Server::serve(&["--kv-transfer-config", producer]);
    let decode = Server::serve(&["--kv-transfer-config", consumer]);
    let proxy = Server::start(
        "proxy",
        &[
            "--kv-mode",
            "push",
            "--prefill",
            &prefill.base,
            "--decode",
            &decode.base,
        ],
        &[],
    );
    Push {
        prefill,
        decode,
        proxy,
    }
}

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "Once upon a time, in a small village,",
];

async fn verdicts(s: &Server) -> [f64; 3] {
    let mut out = [0.0; 3];
    for (i, v) in ["verified", "mismatch", "unverified"].iter().enumerate() {
        out[i] = s
            .metric("tandem:kv_checksum_loads_total", &[("verdict", v)])
            .await
            .unwrap_or(0.0);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_returns_the_single_instance_answer_verified_streaming_and_concurrent() {
    let single = Server::serve(&[]);
    let d = deploy(&producer_cfg(None), &consumer_cfg("fail", 30.0, None));
    let long = "Describe the history of the city and its old harbour. ".repeat(10);
    let mut prompts: Vec<String> = PROMPTS.iter().map(|s| s.to_string()).collect();
    prompts.push(long);
    let mut loads = 0.0;
    for p in &prompts {
        let want = greedy_ids(&single.base, p, 12).await;
        assert_eq!(greedy_ids(&d.proxy.base, p, 12).await, want, "prompt {p:?}");
        let (_, streamed) = stream_text(&d.proxy.base, p, 12).await;
        assert_eq!(streamed, want, "streamed prompt {p:?}");
        loads += 2.0;
    }
    let mut want = Vec::new();
    for p in &PROMPTS {
        want.push(greedy_ids(&single.base, p, 10).await);
    }
    let futs = (0..16).map(|i| {
        let base = d.proxy.base.clone();
        async move { (i % 4, greedy_ids(&base, PROMPTS[i % 4], 10).await) }
    });
    for (p, got) in futures::future::join_all(futs).await {
        assert_eq!(got, want[p], "concurrent prompt {}", PROMPTS[p]);
        loads += 1.0;
    }
    // Every load was verified against checksums that came on the notification.
    assert_eq!(verdicts(&d.decode).await, [loads, 0.0, 0.0]);
    assert_eq!(
        d.prefill
            .metric("tandem:kv_checksum_sends_total", &[])
            .await,
        Some(loads)
    );
    let written = d
        .prefill
        .metric("tandem:kv_transfer_bytes_total", &[])
        .await
        .unwrap();
    assert!(written > 0.0, "the producer WRITEs");
    // vLLM's NIXL shapes: one observation per WRITE, the same bytes.
    assert_eq!(
        d.prefill
            .metric("tandem:nixl_xfer_time_seconds_count", &[])
            .await,
        Some(loads)
    );
    assert_eq!(
        d.prefill
            .metric("tandem:nixl_bytes_transferred_sum", &[])
            .await,
        Some(written)
    );
    assert!(
        d.prefill
            .metric("tandem:nixl_num_descriptors_sum", &[])
            .await
            .unwrap()
            >= loads
    );
    for s in [&d.prefill, &d.decode] {
        assert_eq!(
            s.metric("tandem:kv_transfer_failures_total", &[]).await,
            Some(0.0)
        );
    }
    common::wait_all_free(&[&d.prefill, &d.decode]).await;
}

/// A consumer config with fail-closed checksums or not.
fn consumer_cfg_open(policy: &str, engine_fault: Option<&str>) -> String {
    consumer_cfg(policy, 30.0, engine_fault).replace(
        r#""kv_checksum_fail_closed":true"#,
        r#""kv_checksum_fail_closed":false"#,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_faults_are_caught_and_handled_by_policy() {
    let single = Server::serve(&[]);
    let prompt = PROMPTS[3];
    let want = greedy_ids(&single.base, prompt, 8).await;
    drop(single);
    // (producer transport fault, consumer engine fault, verdict): every fault of the pull tests,
    // plus the push producer's own.
    let cases = [
        (None, Some("corrupt_byte"), "mismatch"),
        (None, Some("swap_blocks"), "mismatch"),
        (None, Some("stale_blocks"), "mismatch"),
        (None, Some("malform_checksums"), "unverified"),
        (None, Some("drop_checksums"), "unverified"),
        (Some("wrong_block"), None, "mismatch"),
        (Some("drop_checksums"), None, "unverified"),
    ];
    for (transport, engine, verdict) in cases {
        let what = format!("{transport:?}/{engine:?}");
        // fail-closed + recompute: the right answer, the bad load counted.
        let d = deploy(
            &producer_cfg(transport),
            &consumer_cfg("recompute", 30.0, engine),
        );
        assert_eq!(greedy_ids(&d.proxy.base, prompt, 8).await, want, "{what}");
        let count = d
            .decode
            .metric("tandem:kv_checksum_loads_total", &[("verdict", verdict)])
            .await;
        assert_eq!(count, Some(1.0), "{what}");
        common::wait_all_free(&[&d.prefill, &d.decode]).await;
        drop(d);
        // fail-closed + fail: the client gets the error.
        let d = deploy(
            &producer_cfg(transport),
            &consumer_cfg("fail", 30.0, engine),
        );
        let (st, v) = post(
            &d.proxy.base,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}),
        )
        .await;
        assert!(st >= 500, "{what}: {st} {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("checksum"), "{what}: {msg}");
        common::wait_all_free(&[&d.prefill, &d.decode]).await;
        drop(d);
        // fail-open: counted, and the request still completes.
        let d = deploy(&producer_cfg(transport), &consumer_cfg_open("fail", engine));
        let (st, v) = post(
            &d.proxy.base,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}),
        )
        .await;
        assert_eq!(st, 200, "{what} fail-open: {v}");
        let count = d
            .decode
            .metric("tandem:kv_checksum_loads_total", &[("verdict", verdict)])
            .await;
        assert_eq!(count, Some(1.0), "{what} fail-open");
        common::wait_all_free(&[&d.prefill, &d.decode]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_that_does_not_decode_ends_the_load_by_its_timeout() {
    let single = Server::serve(&[]);
    let prompt = PROMPTS[0];
    let want = greedy_ids(&single.base, prompt, 8).await;
    drop(single);
    let d = deploy(
        &producer_cfg(Some("garble_notif")),
        &consumer_cfg("recompute", 2.0, None),
    );
    let t = std::time::Instant::now();
    assert_eq!(greedy_ids(&d.proxy.base, prompt, 8).await, want);
    assert!(
        t.elapsed() >= Duration::from_secs(2),
        "waited for the timeout"
    );
    assert_eq!(
        d.decode
            .metric("tandem:kv_transfer_failed_notifications_total", &[])
            .await,
        Some(1.0)
    );
    assert_eq!(
        d.decode
            .metric("tandem:kv_load_failures_total", &[("policy", "recompute")])
            .await,
        Some(1.0)
    );
    common::wait_all_free(&[&d.prefill, &d.decode]).await;
}

/// A push request sent straight to the consumer, naming a producer and a transfer id.
fn push_body(prompt: &str, transfer_id: &str, producer_port: u16) -> Value {
    json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": true,
        "kv_transfer_params": {"do_remote_prefill": true, "transfer_id": transfer_id,
            "remote_host": "127.0.0.1", "remote_port": producer_port}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_or_silent_producers_and_a_dead_consumer_follow_the_policy_without_leaks() {
    let single = Server::serve(&[]);
    let prompt = PROMPTS[1];
    let want = greedy_ids(&single.base, prompt, 8).await;
    drop(single);
    let producer = Server::serve(&["--kv-transfer-config", &producer_cfg(None)]);
    let dead_port = common::free_port();
    for policy in ["fail", "recompute"] {
        let decode = Server::serve(&["--kv-transfer-config", &consumer_cfg(policy, 2.0, None)]);
        // A producer that is gone: the registration cannot be delivered; the load fails at once.
        // A producer that never gets the request: the load ends by its timeout.
        // A producer killed after the registration, before its WRITE: the same.
        for (port, tid) in [
            (dead_port, "gone"),
            (producer.port, "silent"),
            (0, "killed"),
        ] {
            let doomed =
                (port == 0).then(|| Server::serve(&["--kv-transfer-config", &producer_cfg(None)]));
            let port = doomed.as_ref().map_or(port, |p| p.port);
            let body = push_body(prompt, &format!("{tid}-{policy}"), port);
            let base = decode.base.clone();
            let call = tokio::spawn(async move { post(&base, "/v1/completions", &body).await });
            if let Some(p) = doomed {
                tokio::time::sleep(Duration::from_millis(700)).await; // registered by now
                drop(p);
            }
            let (st, v) = call.await.unwrap();
            match policy {
                "fail" => {
                    assert!(st >= 500, "{tid}: {st} {v}");
                    let msg = v["error"]["message"].as_str().unwrap_or_default();
                    assert!(msg.contains("KV"), "{tid}: {msg}");
                }
                _ => {
                    assert_eq!(st, 200, "{tid}: {v}");
                    assert_eq!(ids(&v), want, "{tid}: recomputed");
                }
            }
        }
        common::wait_all_free(&[&decode]).await;
    }
    // A consumer killed after registering: the producer's WRITE fails, and it frees its blocks.
    let decode = Server::serve(&["--kv-transfer-config", &consumer_cfg("fail", 30.0, None)]);
    let body = push_body(prompt, "orphan-1", producer.port);
    let base = decode.base.clone();
    let pending = tokio::spawn(async move { post(&base, "/v1/completions", &body).await });
    for _ in 0..200 {
        let waiting = decode
            .metric("tandem:num_requests_waiting_for_remote_kv", &[])
            .await
            .unwrap_or(0.0);
        if waiting >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await; // its registration is on its way
    drop(decode);
    pending.abort();
    let (st, v) = post(
        &producer.base,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": true, "transfer_id": "orphan-1"}}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    common::wait_all_free(&[&producer]).await;
    let failed = producer
        .metric("tandem:kv_transfer_failures_total", &[])
        .await
        .unwrap_or(0.0);
    assert!(failed >= 1.0, "the WRITE to the dead consumer failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modes_do_not_mix() {
    common::require_model();
    let push_producer = Server::serve(&["--kv-transfer-config", &producer_cfg(None)]);
    let pull_consumer = Server::serve(&[
        "--kv-transfer-config",
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}"#,
    ]);
    // A pull proxy's producer request reaches a push producer: 400, saying what to do.
    let (st, v) = post(
        &push_producer.base,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    assert_eq!(st, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("pull mode") && msg.contains("--kv-mode push"),
        "{msg}"
    );
    // Push params reach a pull consumer: 400 too.
    let (st, v) = post(
        &pull_consumer.base,
        "/v1/completions",
        &push_body("Hi", "t-1", push_producer.port),
    )
    .await;
    assert_eq!(st, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("push mode"), "{msg}");
    // A push consumer registering with a pull producer: the handshake names both modes.
    let push_consumer = Server::serve(&["--kv-transfer-config", &consumer_cfg("fail", 5.0, None)]);
    let pull_producer = Server::serve(&[
        "--kv-transfer-config",
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer"}"#,
    ]);
    let (st, v) = post(
        &push_consumer.base,
        "/v1/completions",
        &push_body("Hi", "t-2", pull_producer.port),
    )
    .await;
    assert!(st >= 500, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("runs pull mode"), "{msg}");
    common::wait_all_free(&[&push_consumer, &pull_producer, &push_producer]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_after_the_producer_freed_is_refused_with_the_reason() {
    common::require_model();
    let lease = r#"{"kv_connector":"NixlPushConnector","kv_role":"kv_producer","enable_kv_checksum":true,"kv_connector_extra_config":{"kv_lease_duration":1}}"#;
    let producer = Server::serve(&["--kv-transfer-config", lease]);
    let decode = Server::serve(&["--kv-transfer-config", &consumer_cfg("fail", 30.0, None)]);
    let prompt = PROMPTS[2];
    // The producer finishes first; nobody registers within its 1 s hold, so it frees.
    let (st, v) = post(
        &producer.base,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": true, "transfer_id": "late-1"}}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    common::wait_all_free(&[&producer]).await;
    assert_eq!(
        producer.metric("tandem:kv_lease_expired_total", &[]).await,
        Some(1.0)
    );
    // The late consumer is told at once why, instead of waiting for its load timeout.
    let t = std::time::Instant::now();
    let (st, v) = post(
        &decode.base,
        "/v1/completions",
        &push_body(prompt, "late-1", producer.port),
    )
    .await;
    assert!(st >= 500, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("has ended on this producer"), "{msg}");
    assert!(t.elapsed() < Duration::from_secs(10), "failed fast");
    common::wait_all_free(&[&decode]).await;
}
