//! Faults where the KV bytes move, over real NIXL between real processes, caught by the
//! checksums under fail-closed and recomputed to the single instance's answer:
//! - a byte flipped in the producer's memory after the checksums, before the READ;
//! - a READ of the wrong producer blocks;
//! - a slow consumer that reads after the producer's lease expired and the blocks were reused
//!   by other requests (the race made deterministic with a delay).
//!
//! Each is counted as a mismatched load and a recompute on the consumer.

mod common;

use std::time::Duration;

use common::Server;
use serde_json::{json, Value};

fn producer(extra: &str) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"kv_producer","enable_kv_checksum":true,"kv_connector_extra_config":{{{extra}}}}}"#
    )
}

fn consumer(extra: &str) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"kv_consumer","enable_kv_checksum":true,"kv_checksum_fail_closed":true,"kv_load_failure_policy":"recompute","kv_connector_extra_config":{{{extra}}}}}"#
    )
}

async fn post(base: &str, body: &Value) -> Value {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

async fn answer(base: &str, prompt: &str, params: Option<&Value>) -> Vec<u64> {
    let mut body =
        json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": true});
    if let Some(p) = params {
        body["kv_transfer_params"] = p.clone();
    }
    let v = post(base, &body).await;
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

async fn prefill(producer: &Server, prompt: &str) -> Value {
    let params = common::prefill_params(producer, prompt).await;
    assert!(params["kv_checksums"].is_string(), "{params}");
    params
}

async fn assert_caught(decode: &Server, what: &str) {
    assert_eq!(
        decode
            .metric("tandem:kv_checksum_loads_total", &[("verdict", "mismatch")])
            .await,
        Some(1.0),
        "{what}: the mismatch is counted"
    );
    assert_eq!(
        decode
            .metric("tandem:kv_load_failures_total", &[("policy", "recompute")])
            .await,
        Some(1.0),
        "{what}: and recomputed"
    );
    assert!(
        decode
            .metric("tandem:kv_checksum_mismatched_blocks_total", &[])
            .await
            >= Some(1.0)
    );
}

const PROMPT: &str = "The old lighthouse keeper climbed the stairs every evening, counting the \
                      steps, checking the lamp, and writing the weather in his book. One night";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_flipped_in_the_producers_memory_before_the_read_is_caught() {
    let single = Server::serve(&[]);
    let want = answer(&single.base, PROMPT, None).await;
    let p = Server::serve(&[
        "--kv-transfer-config",
        &producer(r#""transport_fault_injection":{"kind":"corrupt_source","seed":11}"#),
    ]);
    let d = Server::serve(&["--kv-transfer-config", &consumer("")]);
    let params = prefill(&p, PROMPT).await;
    assert_eq!(answer(&d.base, PROMPT, Some(&params)).await, want);
    assert_caught(&d, "corrupt_source").await;
    assert!(p
        .log_text()
        .contains("transport fault injected (corrupt_source"));
    common::wait_all_free(&[&p, &d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_of_the_wrong_blocks_is_caught() {
    let single = Server::serve(&[]);
    let want = answer(&single.base, PROMPT, None).await;
    let p = Server::serve(&["--kv-transfer-config", &producer("")]);
    let d = Server::serve(&[
        "--kv-transfer-config",
        &consumer(r#""transport_fault_injection":{"kind":"wrong_block","seed":5}"#),
    ]);
    let params = prefill(&p, PROMPT).await;
    assert!(params["remote_block_ids"].as_array().unwrap().len() >= 2);
    assert_eq!(answer(&d.base, PROMPT, Some(&params)).await, want);
    assert_caught(&d, "wrong_block").await;
    assert!(d
        .log_text()
        .contains("transport fault injected (wrong_block"));
    common::wait_all_free(&[&p, &d]).await;
}

/// The producer's lease (1 s) ends while the consumer waits (8 s: room for the fillers below
/// on a loaded 2-core machine) between its granted claim and its READ; other requests then reuse
/// the freed blocks. The READ returns their KV, not the
/// prompt's: the checksums catch it and the consumer recomputes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_after_the_lease_expired_and_the_blocks_were_reused_is_caught() {
    let single = Server::serve(&[]);
    let want = answer(&single.base, PROMPT, None).await;
    let p = Server::serve(&[
        "--kv-transfer-config",
        &producer(r#""kv_lease_duration":1"#),
        "--num-kv-blocks",
        "12",
        "--enable-prefix-caching",
        "false",
    ]);
    let d = Server::serve(&[
        "--kv-transfer-config",
        &consumer(r#""transport_fault_injection":{"kind":"slow_read","delay":8}"#),
    ]);
    let params = prefill(&p, PROMPT).await;
    let blocks = params["remote_block_ids"].as_array().unwrap().len();
    let load = {
        let base = d.base.clone();
        let params = params.clone();
        tokio::spawn(async move { answer(&base, PROMPT, Some(&params)).await })
    };
    // The lease expires after 1 s and the producer frees the blocks; fill every block of its
    // cache with other prompts' KV, several times over.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        p.metric("tandem:kv_lease_expired_total", &[]).await,
        Some(1.0),
        "the lease expired before the READ"
    );
    for i in 0..4 {
        let filler = format!("Item {i}: a list of colours, red green blue yellow, and more. ")
            .repeat(blocks + 1);
        let v = post(
            &p.base,
            &json!({"prompt": filler, "max_tokens": 1, "temperature": 0}),
        )
        .await;
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize > 16 * blocks);
    }
    assert_eq!(
        load.await.unwrap(),
        want,
        "recomputed, not decoded from reused blocks"
    );
    assert_caught(&d, "slow_read").await;
    common::wait_all_free(&[&p, &d]).await;
}

/// A consumer that splits its READs into one-block chunks (`read_chunk_bytes`) checksums each
/// chunk as it lands: a clean load verifies, and a byte flipped in the producer's memory is
/// still caught and recomputed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_reads_verify_as_they_land_and_a_flipped_byte_is_still_caught() {
    let long = format!("{PROMPT} {PROMPT} {PROMPT}");
    let single = Server::serve(&[]);
    let want = answer(&single.base, &long, None).await;
    drop(single);
    // No prefix cache: the second load of the same prompt reads every block again.
    let d = Server::serve(&[
        "--kv-transfer-config",
        &consumer(r#""read_chunk_bytes":1"#),
        "--enable-prefix-caching",
        "false",
    ]);
    let clean = Server::serve(&["--kv-transfer-config", &producer("")]);
    let params = prefill(&clean, &long).await;
    assert!(params["remote_block_ids"].as_array().unwrap().len() >= 4);
    assert_eq!(answer(&d.base, &long, Some(&params)).await, want);
    assert_eq!(
        d.metric("tandem:kv_checksum_loads_total", &[("verdict", "verified")])
            .await,
        Some(1.0),
        "the chunked load verifies"
    );
    common::wait_all_free(&[&clean, &d]).await;
    drop(clean);

    let p = Server::serve(&[
        "--kv-transfer-config",
        &producer(r#""transport_fault_injection":{"kind":"corrupt_source","seed":11}"#),
    ]);
    let params = prefill(&p, &long).await;
    assert_eq!(answer(&d.base, &long, Some(&params)).await, want);
    assert_caught(&d, "corrupt_source, chunked READ").await;
    assert_eq!(
        d.metric("tandem:kv_checksum_load_wait_seconds_count", &[])
            .await,
        Some(2.0),
        "each load's wait after its last chunk is measured"
    );
    common::wait_all_free(&[&p, &d]).await;
}
