//! Gemma 3 270M served end to end: its two KV cache groups (full attention, and sliding window
//! of 512 tokens) move between a prefill and a decode instance over real NIXL and are verified
//! group by group. A prompt much longer than the window returns the single instance's answer
//! with both groups verified, the sliding-window group moving only the blocks of its window; a
//! byte corrupted in the sliding-window group only is a mismatch that names that group.

mod common;

use common::{greedy_ids, verdict, with_transfer_config, Pd, Server};
use serde_json::json;

fn require_gemma() {
    assert!(
        common::repo_root()
            .join(".models/gemma-3-270m-q4_k_m.gguf")
            .exists(),
        "Gemma 3 is missing: run scripts/setup.sh first"
    );
}

fn cfg(role: &str, extra: &str) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"{role}","enable_kv_checksum":true,"kv_checksum_fail_closed":true{extra}}}"#
    )
}

const FAIL: &str = r#","kv_load_failure_policy":"fail""#;
const RECOMPUTE: &str = r#","kv_load_failure_policy":"recompute""#;

const BASE: &[&str] = &["--model", "gemma3-270m", "--num-kv-blocks", "256"];

/// About 900 tokens: well past the 512-token window.
fn long_prompt() -> String {
    "The tide came in over the flats at dusk, and the birds rose in long grey lines. ".repeat(45)
        + "Describe the evening:"
}

fn deploy(decode_extra: &str) -> Pd {
    Pd::start(
        &with_transfer_config(BASE, &[], &cfg("kv_producer", "")),
        &with_transfer_config(BASE, &[], &cfg("kv_consumer", decode_extra)),
        &[],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_past_the_window_moves_both_groups_verified_and_a_sliding_group_fault_is_caught() {
    require_gemma();
    let prompt = long_prompt();
    let single = Server::start("serve", BASE, &[]);
    let want = greedy_ids(&single.base, &prompt, 12).await;
    let (st, chat) = common::post(
        &single.base,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                "temperature": 0}),
    )
    .await;
    assert_eq!(st, 200, "{chat}");
    drop(single);

    let pd = deploy(FAIL);
    let (st, v) = common::post(
        &pd.proxy.base,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": true}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        common::ids(&v),
        want,
        "P/D answer differs from the single instance"
    );
    assert_eq!(verdict(&pd.decode, "verified").await, 1.0);
    // Each group moved what the consumer's table holds: the 3 full-attention layers every
    // prompt block, the 15 sliding-window layers only the blocks of the 512-token window.
    let p = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(p > 800, "{p}");
    let blocks = p.div_ceil(16);
    // the window of the last prompt token, which the consumer computes again for its logits
    let window_blocks = blocks - (p - 512) / 16;
    let block_bytes = 2 * 16 * 256 * 4; // K and V of 16 tokens, one KV head of 256, f32
    let moved = pd
        .decode
        .metric_total("tandem:nixl_bytes_transferred_sum")
        .await;
    assert_eq!(
        moved,
        ((3 * blocks + 15 * window_blocks) * block_bytes) as f64,
        "{blocks} prompt blocks, {window_blocks} in the window"
    );
    // Again: the consumer's prefix cache holds the prompt in both groups (the sliding group's
    // window before the hit), so only what it lacks moves.
    let again = greedy_ids(&pd.proxy.base, &prompt, 12).await;
    assert_eq!(
        again, want,
        "P/D answer after a consumer prefix hit differs"
    );
    let moved_again = pd
        .decode
        .metric_total("tandem:nixl_bytes_transferred_sum")
        .await
        - moved;
    assert!(
        moved_again <= (18 * block_bytes) as f64,
        "a prefix hit still moved {moved_again} bytes"
    );
    let log = pd.decode.log_text();
    assert!(log.contains("KV load verified") || verdict(&pd.decode, "mismatch").await == 0.0);
    common::wait_all_free(&[&pd.prefill, &pd.decode]).await;
    drop(pd);

    // group 1 is the sliding-window group; only its layers are corrupted
    let fault = r#","kv_fault_injection":{"kind":"corrupt_byte","seed":3,"group":1}"#;
    let pd = deploy(&format!("{FAIL}{fault}"));
    let (status, body) = common::post(
        &pd.proxy.base,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}),
    )
    .await;
    assert!(status >= 500, "{status}: {body}");
    assert!(body.to_string().contains("group 1 mismatch"), "{body}");
    assert_eq!(verdict(&pd.decode, "mismatch").await, 1.0);
    common::wait_all_free(&[&pd.prefill, &pd.decode]).await;
}

/// Under the recompute policy a fault in either group is caught and recomputed: the answer is
/// the single instance's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_in_either_group_is_recomputed_to_the_single_instance_answer() {
    require_gemma();
    let prompt = long_prompt();
    let single = Server::start("serve", BASE, &[]);
    let want = greedy_ids(&single.base, &prompt, 8).await;
    drop(single);
    for group in [0, 1] {
        let fault =
            format!(r#","kv_fault_injection":{{"kind":"corrupt_byte","seed":9,"group":{group}}}"#);
        let pd = deploy(&format!("{RECOMPUTE}{fault}"));
        let got = greedy_ids(&pd.proxy.base, &prompt, 8).await;
        assert_eq!(got, want, "group {group}: recomputed answer differs");
        assert_eq!(verdict(&pd.decode, "mismatch").await, 1.0, "group {group}");
        let recomputed = pd
            .decode
            .metric_total("tandem:kv_load_recomputed_tokens_total")
            .await;
        assert!(recomputed > 0.0, "group {group}: nothing recomputed");
        let log = pd.decode.log_text();
        assert!(
            log.contains(&format!("group {group} mismatch")),
            "group {group}"
        );
        common::wait_all_free(&[&pd.prefill, &pd.decode]).await;
    }
}

/// A single instance holds one block table per group: its sliding-window group frees the
/// blocks that fall out of the 512-token window. A long prompt prefilled in 128-token chunks
/// (each chunk after the fourth attends past freed blocks) and decoded answers as the same
/// prompt in one chunk, and every block of both pools comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_instance_frees_the_sliding_group_out_of_its_window_and_keeps_the_answer() {
    require_gemma();
    let prompt = long_prompt();
    let whole = Server::start("serve", BASE, &[]);
    let want = greedy_ids(&whole.base, &prompt, 12).await;
    drop(whole);
    let mut args = BASE.to_vec();
    args.extend(["--max-num-batched-tokens", "128"]);
    let chunked = Server::start("serve", &args, &[]);
    let got = greedy_ids(&chunked.base, &prompt, 12).await;
    assert_eq!(
        got, want,
        "chunked prefill over the window changed the answer"
    );
    for group in ["0", "1"] {
        let total = chunked
            .metric("tandem:kv_cache_group_total_blocks", &[("group", group)])
            .await;
        assert_eq!(total, Some(256.0), "group {group}");
    }
    common::wait_all_free(&[&chunked]).await;
    for group in ["0", "1"] {
        let free = chunked
            .metric("tandem:kv_cache_group_free_blocks", &[("group", group)])
            .await;
        assert_eq!(free, Some(256.0), "group {group}");
    }
}
