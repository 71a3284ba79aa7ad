//! KV checksums end to end: real producer and consumer processes, real NIXL, the real model and
//! the proxy. Clean runs verify every load; every injected fault is caught and handled by policy.

mod common;

use std::time::Duration;

use common::Server;
use serde_json::{json, Value};

fn producer_cfg() -> String {
    r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer","enable_kv_checksum":true}"#.into()
}

fn consumer_cfg(fail_closed: bool, policy: &str, fault: Option<&str>) -> String {
    let fault = fault
        .map(|k| format!(r#","kv_fault_injection":{{"kind":"{k}","probability":1.0,"seed":7}}"#))
        .unwrap_or_default();
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"kv_consumer","enable_kv_checksum":true,"kv_checksum_fail_closed":{fail_closed},"kv_load_failure_policy":"{policy}"{fault}}}"#
    )
}

async fn complete(base: &str, prompt: &str, max_tokens: usize) -> (u16, Value) {
    let r = reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": true}))
        .send()
        .await
        .unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap())
}

fn ids(v: &Value) -> Value {
    v["choices"][0]["token_ids"].clone()
}

struct Pd {
    prefill: Server,
    decode: Server,
    proxy: Server,
}

fn deploy(consumer: &str) -> Pd {
    let prefill = Server::serve(&["--kv-transfer-config", &producer_cfg()]);
    let decode = Server::serve(&["--kv-transfer-config", consumer]);
    let proxy = Server::start(
        "proxy",
        &["--prefill", &prefill.base, "--decode", &decode.base],
        &[],
    );
    Pd {
        prefill,
        decode,
        proxy,
    }
}

const PROMPTS: [&str; 5] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "Hi",
    "The river flows through the old town, past the market and the mill, and on to the sea where",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_runs_verify_every_load() {
    let d = deploy(&consumer_cfg(true, "fail", None));
    let n = 200;
    let futs = (0..n).map(|i| {
        let base = d.proxy.base.clone();
        async move { complete(&base, PROMPTS[i % PROMPTS.len()], 2).await }
    });
    let results = futures::stream::iter(futs)
        .buffer_unordered(8)
        .collect::<Vec<_>>()
        .await;
    for (st, v) in &results {
        assert_eq!(*st, 200, "{v}");
    }
    let verified = d
        .decode
        .metric("tandem:kv_checksum_loads_total", &[("verdict", "verified")])
        .await;
    assert_eq!(verified, Some(n as f64));
    assert_eq!(
        d.decode
            .metric("tandem:kv_checksum_loads_total", &[("verdict", "mismatch")])
            .await,
        Some(0.0)
    );
    assert_eq!(
        d.decode
            .metric(
                "tandem:kv_checksum_loads_total",
                &[("verdict", "unverified")]
            )
            .await,
        Some(0.0)
    );
    assert_eq!(
        d.prefill
            .metric("tandem:kv_checksum_sends_total", &[])
            .await,
        Some(n as f64)
    );
}

use futures::StreamExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_is_caught_and_handled_by_policy() {
    let single = Server::serve(&[]);
    let prompt = PROMPTS[4];
    let (_, want) = complete(&single.base, prompt, 8).await;
    drop(single);
    let faults = [
        ("corrupt_byte", "mismatch"),
        ("swap_blocks", "mismatch"),
        ("stale_blocks", "mismatch"),
        ("drop_checksums", "unverified"),
        ("malform_checksums", "unverified"),
    ];
    for (fault, verdict) in faults {
        // fail-closed + recompute: the right answer, the bad load counted.
        let d = deploy(&consumer_cfg(true, "recompute", Some(fault)));
        let (st, v) = complete(&d.proxy.base, prompt, 8).await;
        assert_eq!(st, 200, "{fault}: {v}");
        assert_eq!(ids(&v), ids(&want), "{fault}: recomputed answer");
        let count = d
            .decode
            .metric("tandem:kv_checksum_loads_total", &[("verdict", verdict)])
            .await;
        assert_eq!(count, Some(1.0), "{fault}");
        let fails = d
            .decode
            .metric("tandem:kv_load_failures_total", &[("policy", "recompute")])
            .await;
        assert_eq!(fails, Some(1.0), "{fault}");
        drop(d);
        // fail-closed + fail: the client gets the error.
        let d = deploy(&consumer_cfg(true, "fail", Some(fault)));
        let (st, v) = complete(&d.proxy.base, prompt, 8).await;
        assert!(st >= 500, "{fault}: {st} {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("checksum"), "{fault}: {msg}");
        drop(d);
        // fail-open: counted, and the request still completes.
        let d = deploy(&consumer_cfg(false, "fail", Some(fault)));
        let (st, v) = complete(&d.proxy.base, prompt, 8).await;
        assert_eq!(st, 200, "{fault}: {v}");
        let count = d
            .decode
            .metric("tandem:kv_checksum_loads_total", &[("verdict", verdict)])
            .await;
        assert_eq!(count, Some(1.0), "{fault} fail-open");
    }
}
