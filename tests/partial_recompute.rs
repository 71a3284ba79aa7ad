//! Recompute from the first bad block, end to end: a real producer, consumers over real NIXL and
//! the real model. A byte corrupted in block k of an n-block prompt (fail-closed, policy
//! `recompute`) keeps the k verified blocks and prefills only the rest: the consumer's computed
//! prompt tokens (`tandem:prompt_tokens_total`, what its scheduler ran) and its recomputed-token
//! counter both equal the prompt length minus k blocks, and the answer equals the single
//! instance's. With `kv_partial_recompute: false`, the same fault recomputes the whole prompt.

mod common;

use std::time::Duration;

use common::{wait_all_free, Server};
use serde_json::{json, Value};

const BLOCK: usize = 16;
const PROMPT: &str = "The river flows through the old town, past the market and the mill, under \
    seven stone bridges and along the gardens of the abbey, where the monks once kept bees and \
    grew pears for the winter. In spring the water rises and the boatmen wait at the quay for the \
    flood to pass; in summer children swim below the weir. Describe the town in one sentence:";

fn consumer_cfg(block_position: usize, partial: bool) -> String {
    json!({
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "enable_kv_checksum": true,
        "kv_checksum_fail_closed": true,
        "kv_load_failure_policy": "recompute",
        "kv_partial_recompute": partial,
        "kv_fault_injection": {"kind": "corrupt_byte", "seed": 11, "block_position": block_position},
    })
    .to_string()
}

async fn post(url: &str, body: Value) -> Value {
    let r = reqwest::Client::new()
        .post(url)
        .json(&body)
        .timeout(Duration::from_secs(300))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    v
}

/// Greedy completion of `prompt` (text or token ids) on a single instance: (prompt ids, output ids).
async fn reference(server: &Server, prompt: Value) -> (Vec<u64>, Value) {
    let v = post(
        &server.url("/v1/completions"),
        json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": true}),
    )
    .await;
    let prompt_ids = v["prompt_token_ids"]
        .as_array()
        .expect("prompt_token_ids")
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    (prompt_ids, v["choices"][0]["token_ids"].clone())
}

/// Prefills `prompt_ids` on the producer as the proxy does, then decodes on `consumer` with the
/// producer's params: the consumer's output ids.
async fn pd(producer: &Server, consumer: &Server, prompt_ids: &[u64]) -> Value {
    let p = post(
        &producer.url("/v1/completions"),
        json!({"prompt": prompt_ids, "max_tokens": 1, "temperature": 0,
               "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    let params = p["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{p}");
    let v = post(
        &consumer.url("/v1/completions"),
        json!({"prompt": prompt_ids, "max_tokens": 8, "temperature": 0, "return_token_ids": true,
               "kv_transfer_params": params}),
    )
    .await;
    v["choices"][0]["token_ids"].clone()
}

/// A consumer's counters that tell what it recomputed.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Counts {
    prompt_tokens: f64,
    recomputed: f64,
    recompute_prompt: f64,
    mismatches: f64,
    failures: f64,
}

async fn counts(s: &Server) -> Counts {
    let m = |name: &'static str, labels: &'static [(&'static str, &'static str)]| async move {
        s.metric(name, labels).await.unwrap_or(0.0)
    };
    Counts {
        prompt_tokens: m("tandem:prompt_tokens_total", &[]).await,
        recomputed: m("tandem:kv_load_recomputed_tokens_total", &[]).await,
        recompute_prompt: m("tandem:kv_load_recompute_prompt_tokens_total", &[]).await,
        mismatches: m("tandem:kv_checksum_loads_total", &[("verdict", "mismatch")]).await,
        failures: m("tandem:kv_load_failures_total", &[("policy", "recompute")]).await,
    }
}

fn producer() -> Server {
    Server::serve(&[
        "--num-kv-blocks",
        "256",
        "--kv-transfer-config",
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer","enable_kv_checksum":true}"#,
    ])
}

fn consumer(block_position: usize, partial: bool) -> Server {
    Server::serve(&[
        "--num-kv-blocks",
        "256",
        "--kv-transfer-config",
        &consumer_cfg(block_position, partial),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_block_recomputes_only_from_that_block() {
    let producer = producer();
    // The producer answers plain requests as a single instance would.
    let (prompt_ids, want) = reference(&producer, json!(PROMPT)).await;
    let n = prompt_ids.len();
    let blocks = n.div_ceil(BLOCK);
    assert!(
        blocks >= 5 && n % BLOCK != 0,
        "{n} tokens: want >= 5 blocks, the last partial"
    );
    let last = blocks - 1;
    // (block corrupted, partial recompute, tokens the consumer must compute again)
    let cases = [
        (0, true, n),
        (2, true, n - 2 * BLOCK),
        (last, true, n - last * BLOCK),
        (2, false, n),
    ];
    for (k, partial, want_recomputed) in cases {
        let c = consumer(k, partial);
        let got = pd(&producer, &c, &prompt_ids).await;
        assert_eq!(
            got, want,
            "block {k} of {blocks}, partial {partial}: answer"
        );
        let after = counts(&c).await;
        let case = format!("block {k} of {blocks} ({n} tokens), partial {partial}");
        assert_eq!(after.mismatches, 1.0, "{case}");
        assert_eq!(after.failures, 1.0, "{case}");
        assert_eq!(
            after.recomputed, want_recomputed as f64,
            "{case}: recomputed"
        );
        assert_eq!(after.recompute_prompt, n as f64, "{case}: prompt tokens");
        // What the scheduler ran: exactly the recomputed tokens (a good load computes 1).
        assert_eq!(
            after.prompt_tokens, want_recomputed as f64,
            "{case}: scheduled"
        );
        wait_all_free(&[&producer, &c]).await;
    }
}

/// A consumer that already holds the prompt's first blocks (a local prefix hit) loads the rest;
/// a corruption in that load keeps both its own blocks and the verified loaded ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_prefix_and_the_verified_loaded_blocks_are_both_kept() {
    let producer = producer();
    let (prompt_ids, want) = reference(&producer, json!(PROMPT)).await;
    let n = prompt_ids.len();
    // corrupt block 3; the consumer holds blocks 0 and 1 from a local request sharing 40 tokens
    let c = consumer(3, true);
    let mut other = prompt_ids[..40].to_vec();
    other.extend(prompt_ids[40..].iter().rev());
    reference(&c, json!(other)).await;
    let before = counts(&c).await;
    let got = pd(&producer, &c, &prompt_ids).await;
    assert_eq!(got, want, "answer");
    let after = counts(&c).await;
    let hits = c
        .metric("tandem:prefix_cache_hits_total", &[])
        .await
        .unwrap_or(0.0);
    assert!(
        hits >= 32.0,
        "the local prefix was not found: {hits} hit tokens"
    );
    assert_eq!(after.mismatches - before.mismatches, 1.0);
    assert_eq!(
        after.recomputed - before.recomputed,
        (n - 3 * BLOCK) as f64,
        "recomputed"
    );
    assert_eq!(
        after.prompt_tokens - before.prompt_tokens,
        (n - 3 * BLOCK) as f64,
        "scheduled"
    );
    wait_all_free(&[&producer, &c]).await;
}
