//! Different producer and consumer block sizes on the real path: real processes, real NIXL, the
//! real model. Pull with a consumer of 32-token blocks reading a producer's 16-token blocks, push
//! with a producer of 32-token blocks writing into a consumer's 16-token blocks: both verify
//! their checksums, and a corrupted byte is caught in each. A push consumer whose prefix hit ends
//! inside a producer block cannot compare its first loaded block: unverified. Other ratios are
//! refused, naming both block sizes.

mod common;

use common::{greedy_ids, post, Server};
use serde_json::json;

fn cfg(connector: &str, role: &str, extra: &str) -> String {
    format!(
        r#"{{"kv_connector":"{connector}","kv_role":"{role}","enable_kv_checksum":true,"kv_checksum_fail_closed":true,"kv_load_failure_policy":"recompute"{extra}}}"#
    )
}

const CORRUPT: &str =
    r#","kv_fault_injection":{"kind":"corrupt_byte","probability":1.0,"seed":11}"#;

struct Pd {
    prefill: Server,
    decode: Server,
    proxy: Server,
}

fn deploy(mode: &str, prefill_bs: &str, decode_bs: &str, decode_extra: &str) -> Pd {
    common::require_model();
    let connector = if mode == "push" {
        "NixlPushConnector"
    } else {
        "NixlConnector"
    };
    let prefill = Server::serve(&[
        "--block-size",
        prefill_bs,
        "--kv-transfer-config",
        &cfg(connector, "kv_producer", ""),
    ]);
    let decode = Server::serve(&[
        "--block-size",
        decode_bs,
        "--kv-transfer-config",
        &cfg(connector, "kv_consumer", decode_extra),
    ]);
    let proxy = Server::start(
        "proxy",
        &[
            "--kv-mode",
            mode,
            "--prefill",
            &prefill.base,
            "--decode",
            &decode.base,
        ],
        &[],
    );
    Pd {
        prefill,
        decode,
        proxy,
    }
}

async fn verdict(s: &Server, v: &str) -> f64 {
    s.metric("tandem:kv_checksum_loads_total", &[("verdict", v)])
        .await
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_16_to_32_and_push_32_to_16_verify_and_catch_a_corrupted_byte() {
    let single = Server::serve(&[]);
    // Prompts of one, several and a partial last block at either size.
    let prompts = [
        "Hi".to_string(),
        "The capital of France is".to_string(),
        "List the planets of the solar system in order from the sun. ".repeat(4),
    ];
    let mut want = Vec::new();
    for p in &prompts {
        want.push(greedy_ids(&single.base, p, 10).await);
    }
    drop(single);
    for (mode, p_bs, d_bs) in [("pull", "16", "32"), ("push", "32", "16")] {
        let d = deploy(mode, p_bs, d_bs, "");
        for (p, w) in prompts.iter().zip(&want) {
            assert_eq!(&greedy_ids(&d.proxy.base, p, 10).await, w, "{mode} {p:?}");
        }
        let n = prompts.len() as f64;
        assert_eq!(
            verdict(&d.decode, "verified").await,
            n,
            "{mode}: all verified"
        );
        assert_eq!(verdict(&d.decode, "mismatch").await, 0.0, "{mode}");
        assert_eq!(verdict(&d.decode, "unverified").await, 0.0, "{mode}");
        common::wait_all_free(&[&d.prefill, &d.decode]).await;
        drop(d);
        // A byte corrupted in the loaded blocks: a mismatch, recomputed to the right answer.
        let d = deploy(mode, p_bs, d_bs, CORRUPT);
        let p = &prompts[2];
        assert_eq!(&greedy_ids(&d.proxy.base, p, 10).await, &want[2], "{mode}");
        assert_eq!(verdict(&d.decode, "mismatch").await, 1.0, "{mode}: caught");
        common::wait_all_free(&[&d.prefill, &d.decode]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_prefix_hit_inside_a_producer_block_is_unverified() {
    let single = Server::serve(&[]);
    let d = deploy("push", "32", "16", "");
    // Token prompts: B shares A's first 16 tokens (one consumer block), then differs.
    let a: Vec<u32> = (1000..1040).collect();
    let mut b: Vec<u32> = a[..16].to_vec();
    b.extend(2000..2030);
    let complete = |base: String, prompt: Vec<u32>| async move {
        let (st, v) = post(
            &base,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": true}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        v
    };
    complete(d.proxy.base.clone(), a).await;
    assert_eq!(verdict(&d.decode, "verified").await, 1.0);
    let want = complete(single.base.clone(), b.clone()).await;
    let got = complete(d.proxy.base.clone(), b).await;
    assert_eq!(
        got["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(16),
        "{got}"
    );
    // The first loaded block starts inside the producer's first 32-token block: it cannot be
    // compared, so the load is unverified (fail-closed: recomputed, the answer is still right).
    assert_eq!(verdict(&d.decode, "unverified").await, 1.0);
    assert_eq!(
        got["choices"][0]["token_ids"],
        want["choices"][0]["token_ids"]
    );
    common::wait_all_free(&[&d.prefill, &d.decode]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_ratios_are_refused_naming_both_block_sizes() {
    // Pull with a consumer of smaller blocks than the producer's: its params are refused (400).
    let d = deploy("pull", "32", "16", "");
    let body = json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let (st, v) = post(&d.proxy.base, "/v1/completions", &body).await;
    assert_eq!(st, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("block size 32") && msg.contains("16"), "{msg}");
    common::wait_all_free(&[&d.prefill, &d.decode]).await;
    drop(d);
    // Push with a producer of smaller blocks: the consumer does not register; its load fails
    // (recomputed here), its log names both sizes, and it releases the producer's hold at once
    // (well inside the producer's 30 s lease).
    let d = deploy("push", "16", "32", "");
    let (st, v) = post(&d.proxy.base, "/v1/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        d.decode
            .metric("tandem:kv_load_failures_total", &[("policy", "recompute")])
            .await,
        Some(1.0)
    );
    let log = d.decode.log_text();
    assert!(
        log.contains("the producer's block size 16 is not a multiple of this consumer's 32"),
        "{log}"
    );
    common::wait_all_free_within(&[&d.prefill, &d.decode], std::time::Duration::from_secs(5)).await;
}
