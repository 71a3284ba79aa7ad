//! End-to-end P/D tests: real `tandem serve` producer and consumer processes moving KV over real
//! NIXL, behind a real `tandem proxy`, on the real default model.

mod common;

use common::{client, greedy_ids, ids, post, stream_text, Server};
use serde_json::{json, Value};

const PRODUCER: &str = r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer"}"#;

fn consumer(policy: &str) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":"{policy}"}}"#
    )
}

struct Deployment {
    prefill: Vec<Server>,
    decode: Vec<Server>,
    proxy: Server,
}

fn deploy(
    n_prefill: usize,
    n_decode: usize,
    prefill_extra: &[&str],
    decode_policy: &str,
) -> Deployment {
    common::require_model();
    let prefill: Vec<Server> = (0..n_prefill)
        .map(|_| {
            let mut a = vec!["--kv-transfer-config", PRODUCER];
            a.extend_from_slice(prefill_extra);
            Server::serve(&a)
        })
        .collect();
    let cfg = consumer(decode_policy);
    let decode: Vec<Server> = (0..n_decode)
        .map(|_| Server::serve(&["--kv-transfer-config", &cfg]))
        .collect();
    let mut args: Vec<String> = Vec::new();
    for p in &prefill {
        args.extend(["--prefill".into(), p.base.clone()]);
    }
    for d in &decode {
        args.extend(["--decode".into(), d.base.clone()]);
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = Server::start("proxy", &refs, &[]);
    Deployment {
        prefill,
        decode,
        proxy,
    }
}

const PROMPTS: [&str; 10] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "My favourite fruit is",
    "The quick brown fox",
    "In 1969, astronauts",
    "To make a cup of tea, first",
    "Hi",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_output_equals_single_instance_streaming_and_not() {
    let single = Server::serve(&[]);
    let d = deploy(1, 1, &[], "fail");
    let long_prompt = "Describe the history of the city. ".repeat(12);
    let mut prompts: Vec<String> = PROMPTS.iter().map(|s| s.to_string()).collect();
    prompts.push(long_prompt);
    for p in &prompts {
        let want = greedy_ids(&single.base, p, 16).await;
        let got = greedy_ids(&d.proxy.base, p, 16).await;
        assert_eq!(got, want, "prompt {p:?}");
        let (_, streamed) = stream_text(&d.proxy.base, p, 16).await;
        assert_eq!(streamed, want, "streamed prompt {p:?}");
    }
    // every load moved bytes over NIXL, none failed
    let bytes = d.decode[0]
        .metric("tandem:kv_transfer_bytes_total", &[])
        .await
        .unwrap();
    assert!(bytes > 0.0);
    assert_eq!(
        d.decode[0]
            .metric("tandem:kv_transfer_failures_total", &[])
            .await,
        Some(0.0)
    );
    common::wait_all_free(&[&d.prefill[0], &d.decode[0]]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_requests_and_chunked_prefill_and_decode_prefix_hit() {
    // A producer with a small step budget prefills long prompts in several chunks.
    let d = deploy(1, 1, &["--max-num-batched-tokens", "64"], "fail");
    let single = Server::serve(&[]);
    let long = "The river flows through the old town, past the market and the mill. ".repeat(8);
    let want_long = greedy_ids(&single.base, &long, 12).await;
    assert_eq!(
        greedy_ids(&d.proxy.base, &long, 12).await,
        want_long,
        "chunked prefill"
    );
    // The same prompt again: the decode instance finds its prefix cached and loads only the rest.
    let (st, again) = post(
        &d.proxy.base,
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 12, "temperature": 0, "return_token_ids": true}),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(ids(&again), want_long);
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 16
    );
    // 16 concurrent requests.
    let mut want = Vec::new();
    for p in &PROMPTS[..4] {
        want.push(greedy_ids(&single.base, p, 12).await);
    }
    let futs = (0..16).map(|i| {
        let base = d.proxy.base.clone();
        async move { (i % 4, greedy_ids(&base, PROMPTS[i % 4], 12).await) }
    });
    for (p, got) in futures::future::join_all(futs).await {
        assert_eq!(got, want[p]);
    }
    common::wait_all_free(&[&d.prefill[0], &d.decode[0]]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_producers_one_consumer_and_one_producer_two_consumers() {
    let single = Server::serve(&[]);
    let mut want = Vec::new();
    for p in &PROMPTS[..6] {
        want.push(greedy_ids(&single.base, p, 8).await);
    }
    drop(single);
    for (np, nd) in [(2, 1), (1, 2)] {
        let d = deploy(np, nd, &[], "fail");
        let futs = (0..12).map(|i| {
            let base = d.proxy.base.clone();
            async move { (i % 6, greedy_ids(&base, PROMPTS[i % 6], 8).await) }
        });
        for (p, got) in futures::future::join_all(futs).await {
            assert_eq!(got, want[p], "{np}P{nd}D");
        }
        // every instance took part
        for s in d.prefill.iter().chain(&d.decode) {
            let prompts = s
                .metric("tandem:prompt_tokens_total", &[])
                .await
                .unwrap_or(0.0);
            assert!(prompts > 0.0, "{np}P{nd}D: {} served nothing", s.base);
        }
        let all: Vec<&Server> = d.prefill.iter().chain(&d.decode).collect();
        common::wait_all_free(&all).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_producer_follows_the_failure_policy() {
    let single = Server::serve(&[]);
    let prompt = PROMPTS[1];
    let want = greedy_ids(&single.base, prompt, 10).await;
    for policy in ["fail", "recompute"] {
        let producer = Server::serve(&["--kv-transfer-config", PRODUCER]);
        let cfg = consumer(policy);
        let decode = Server::serve(&["--kv-transfer-config", &cfg]);
        let params = common::prefill_params(&producer, prompt).await;
        drop(producer); // killed before the consumer reads
        let (st, v) = post(
            &decode.base,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": true, "kv_transfer_params": params}),
        )
        .await;
        match policy {
            "fail" => {
                assert!(st >= 500, "{st} {v}");
                assert!(
                    v["error"]["message"]
                        .as_str()
                        .unwrap()
                        .contains("KV load failed"),
                    "{v}"
                );
            }
            _ => {
                assert_eq!(st, 200, "{v}");
                assert_eq!(ids(&v), want, "recomputed locally");
            }
        }
        let fails = decode
            .metric("tandem:kv_load_failures_total", &[("policy", policy)])
            .await;
        assert_eq!(fails, Some(1.0));
        common::wait_all_free(&[&decode]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_consumer_leaves_the_producer_to_free_at_lease_expiry() {
    let cfg = r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"kv_lease_duration":2}}"#;
    let producer = Server::serve(&["--kv-transfer-config", cfg]);
    let _params = common::prefill_params(&producer, PROMPTS[6]).await;
    // nobody reads: the blocks stay held until the lease expires
    let total = producer
        .metric("tandem:kv_cache_total_blocks", &[])
        .await
        .unwrap();
    let held = producer
        .metric("tandem:kv_cache_free_blocks", &[])
        .await
        .unwrap();
    assert!(held < total, "blocks held for the consumer");
    common::wait_all_free(&[&producer]).await;
    assert_eq!(
        producer.metric("tandem:kv_lease_expired_total", &[]).await,
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_or_forged_transfer_params_are_rejected_without_leaks() {
    let producer = Server::serve(&["--kv-transfer-config", PRODUCER]);
    let cfg = consumer("fail");
    let decode = Server::serve(&["--kv-transfer-config", &cfg]);
    let prompt = PROMPTS[0];
    let good = common::prefill_params(&producer, prompt).await;
    let mut wrong_blocks = good.clone();
    wrong_blocks["remote_block_ids"] = json!([1, 2, 3, 4, 5, 6, 7, 8]);
    let mut bad_port = good.clone();
    bad_port["remote_port"] = json!(70000);
    let mut not_list = good.clone();
    not_list["remote_block_ids"] = json!("all of them");
    for params in [
        wrong_blocks,
        bad_port,
        not_list,
        json!({"do_remote_prefill": true}),
    ] {
        let (st, v) = post(
            &decode.base,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params}),
        )
        .await;
        assert_eq!(st, 400, "{params}: {v}");
        assert_eq!(v["error"]["param"], "kv_transfer_params");
    }
    // forged: an engine id that is not the producer's
    let mut forged = good.clone();
    forged["remote_engine_id"] = json!("someone-else");
    let (st, v) = post(
        &decode.base,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "kv_transfer_params": forged}),
    )
    .await;
    assert!(st >= 500, "{v}");
    // the instance still serves, and nothing leaked on either side
    let (st, _) = post(
        &decode.base,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "kv_transfer_params": good}),
    )
    .await;
    assert_eq!(st, 200);
    common::wait_all_free(&[&producer, &decode]).await;
}

/// A deployment as it runs across hosts: a KV transfer secret on both instances, an API key on
/// instances and proxy. Clients need the proxy's key; the proxy sends its own upstream; the
/// answers equal one instance's and every load is verified by the signed path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_and_api_keys_through_the_proxy() {
    let single = Server::serve(&[]);
    let env = [("TANDEM_KV_TRANSFER_SECRET", "pd-test-deployment-secret")];
    let key = "sk-pd-test";
    let producer = Server::start(
        "serve",
        &["--kv-transfer-config", PRODUCER, "--api-key", key],
        &env,
    );
    let cfg = consumer("fail");
    let decode = Server::start(
        "serve",
        &["--kv-transfer-config", &cfg, "--api-key", key],
        &env,
    );
    let proxy = Server::start(
        "proxy",
        &[
            "--prefill",
            &producer.base,
            "--decode",
            &decode.base,
            "--api-key",
            key,
        ],
        &[],
    );
    let body =
        json!({"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "return_token_ids": true});
    let r = client()
        .post(proxy.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "no key, no answer");
    let r = client()
        .post(proxy.url("/v1/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(ids(&v), greedy_ids(&single.base, PROMPTS[0], 12).await);
    assert!(
        decode.metric("tandem:kv_transfer_bytes_total", &[]).await > Some(0.0),
        "the KV moved over NIXL"
    );
    assert_eq!(
        decode.metric_total("tandem:kv_load_failures_total").await,
        0.0
    );
    common::wait_all_free(&[&producer, &decode]).await;
}

/// A request whose prompt leaves no room for its `max_tokens` is refused before any prefill:
/// the proxy passes the output limit to the producer (`decode_max_tokens`), which answers the
/// decode instance's own 400 without running the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_room_to_decode_costs_no_prefill() {
    let producer = Server::serve(&["--kv-transfer-config", PRODUCER, "--max-model-len", "64"]);
    let cfg = consumer("fail");
    let decode = Server::serve(&["--kv-transfer-config", &cfg, "--max-model-len", "64"]);
    let proxy = Server::start(
        "proxy",
        &["--prefill", &producer.base, "--decode", &decode.base],
        &[],
    );
    let (st, v) = post(
        &proxy.base,
        "/v1/completions",
        &json!({"prompt": PROMPTS[1], "max_tokens": 100}),
    )
    .await;
    assert_eq!(st, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("maximum context length is 64"), "{msg}");
    assert_eq!(
        producer
            .metric("tandem:prompt_tokens_total", &[])
            .await
            .unwrap_or(0.0),
        0.0,
        "nothing was prefilled"
    );
    // Within the limit, the same prompt is served.
    let (st, v) = post(
        &proxy.base,
        "/v1/completions",
        &json!({"prompt": PROMPTS[1], "max_tokens": 8}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    common::wait_all_free(&[&producer, &decode]).await;
}
