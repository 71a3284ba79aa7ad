//! P/D between instances that split the model differently, on the real path: real processes,
//! real NIXL, the real model. Each consumer instance's one NIXL agent reads every layer and KV
//! head its ranks hold from the producer rank that holds it (head-major caches, so single heads
//! move), each rank checksums its part, and a load is compared once every rank reported.
//! - SmolLM2 (9 heads, 3 KV heads), (P TP,PP)/(D TP,PP) = (3,1)/(1,1), (1,1)/(3,1), (1,2)/(3,1),
//!   (3,1)/(1,2): the single-instance answers, every load verified, every block freed;
//! - a dummy model with 8 query heads and 2 KV heads at TP 4 (each KV head on two ranks)
//!   against TP 1, both ways: verified, and a byte corrupted in one replica's copy only (the
//!   consumer's TP rank 1 or 3) is a mismatch although the other copy is intact;
//! - token-major caches with different head splits are refused, saying what to set.

mod common;

use common::{
    dummy_gqa_config, greedy_ids, require_model, verdict, wait_all_free, with_transfer_config, Pd,
    Server,
};
use serde_json::json;

fn cfg(role: &str, extra: &str) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"{role}","enable_kv_checksum":true,"kv_checksum_fail_closed":true,"kv_load_failure_policy":"fail"{extra}}}"#
    )
}

/// A 1P1D deployment: `base` flags on both, then each side's layout flags.
fn deploy(base: &[&str], prefill: &[&str], decode: &[&str], decode_extra: &str) -> Pd {
    Pd::start(
        &with_transfer_config(base, prefill, &cfg("kv_producer", "")),
        &with_transfer_config(base, decode, &cfg("kv_consumer", decode_extra)),
        &[],
    )
}

const SMOL: &[&str] = &[
    "--dtype",
    "f32",
    "--num-kv-blocks",
    "192",
    "--kv-cache-layout",
    "head_major",
];

fn prompts() -> Vec<String> {
    vec![
        "The capital of France is".to_string(),
        "List the planets of the solar system in order from the sun. ".repeat(3),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_pairs_of_layouts_answer_as_one_instance_with_every_load_verified() {
    require_model();
    let single = Server::serve(SMOL);
    let mut want = Vec::new();
    for p in prompts() {
        want.push(greedy_ids(&single.base, &p, 12).await);
    }
    drop(single);
    let tp3: &[&str] = &["--tensor-parallel-size", "3"];
    let pp2: &[&str] = &["--pipeline-parallel-size", "2"];
    for (name, p, d) in [
        ("(3,1)/(1,1)", tp3, &[][..]),
        ("(1,1)/(3,1)", &[][..], tp3),
        ("(1,2)/(3,1)", pp2, tp3),
        ("(3,1)/(1,2)", tp3, pp2),
    ] {
        let pd = deploy(SMOL, p, d, "");
        for (prompt, want) in prompts().iter().zip(&want) {
            let got = greedy_ids(&pd.proxy.base, prompt, 12).await;
            assert_eq!(&got, want, "{name}: {prompt:?}");
        }
        assert_eq!(verdict(&pd.decode, "verified").await, 2.0, "{name}");
        assert_eq!(verdict(&pd.decode, "mismatch").await, 0.0, "{name}");
        assert_eq!(verdict(&pd.decode, "unverified").await, 0.0, "{name}");
        // every head of every layer came over: KV bytes of the prompts' blocks
        let bytes = pd
            .decode
            .metric_total("tandem:kv_transfer_bytes_total")
            .await;
        assert!(bytes > 0.0, "{name}: nothing moved");
        wait_all_free(&[&pd.prefill, &pd.decode]).await;
    }
}

const DUMMY_PROMPT: &str = "replicated heads: each KV head of this model lives on two TP ranks";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_kv_heads_move_between_tp4_and_tp1_and_a_corrupted_replica_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let config = dummy_gqa_config(dir.path());
    let base = [
        "--load-format",
        "dummy",
        "--model-config",
        &config,
        "--dtype",
        "f32",
        "--kv-cache-layout",
        "head_major",
        "--num-kv-blocks",
        "64",
    ];
    let single = Server::start("serve", &base, &[]);
    let want = greedy_ids(&single.base, DUMMY_PROMPT, 8).await;
    drop(single);
    let tp4: &[&str] = &["--tensor-parallel-size", "4"];
    for (name, p, d) in [
        ("TP 1 -> TP 4", &[][..], tp4),
        ("TP 4 -> TP 1", tp4, &[][..]),
    ] {
        let pd = deploy(&base, p, d, "");
        let got = greedy_ids(&pd.proxy.base, DUMMY_PROMPT, 8).await;
        assert_eq!(got, want, "{name}");
        assert_eq!(verdict(&pd.decode, "verified").await, 1.0, "{name}");
        wait_all_free(&[&pd.prefill, &pd.decode]).await;
    }
    // One replica's copy corrupted on the TP 4 consumer: ranks 1 and 3 hold replica 1 of heads
    // 0 and 1; ranks 0 and 2 keep an intact copy of the same heads.
    for rank in [1, 3] {
        let fault =
            format!(r#","kv_fault_injection":{{"kind":"corrupt_byte","seed":5,"tp_rank":{rank}}}"#);
        let pd = deploy(&base, &[], tp4, &fault);
        let (status, body) = common::post(
            &pd.proxy.base,
            "/v1/completions",
            &json!({"prompt": DUMMY_PROMPT, "max_tokens": 4, "temperature": 0}),
        )
        .await;
        assert!(
            status >= 500,
            "replica of rank {rank}: fail-closed mismatch answered {status}: {body}"
        );
        assert_eq!(verdict(&pd.decode, "mismatch").await, 1.0, "rank {rank}");
        assert_eq!(verdict(&pd.decode, "verified").await, 0.0, "rank {rank}");
        let log = pd.decode.log_text();
        assert!(log.contains("KV fault injection"), "{log}");
        wait_all_free(&[&pd.prefill, &pd.decode]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_major_caches_with_different_head_splits_are_refused_with_the_fix() {
    require_model();
    let base = ["--dtype", "f32", "--num-kv-blocks", "64"];
    let pd = deploy(&base, &["--tensor-parallel-size", "3"], &[], "");
    let (status, body) = common::post(
        &pd.proxy.base,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 2}),
    )
    .await;
    assert!(!(200..300).contains(&status), "{status}: {body}");
    let log = pd.decode.log_text();
    assert!(log.contains("head_major"), "{body}\n{log}");
    wait_all_free(&[&pd.prefill, &pd.decode]).await;
}
