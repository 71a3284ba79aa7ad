//! Who may move KV, end to end, against real `tandem serve` processes over real NIXL, tried as a
//! hostile client would: one that skips the proxy and talks to a decode instance directly.
//!
//! - Without a secret: a client that names the producer's engine and a victim's block ids reads
//!   nothing of the victim's KV (the producer refuses the lease claim; the consumer recomputes),
//!   and params whose `remote_block_size` differs from the producer's handshake are refused
//!   before the claim,
//!   non-loopback producers are never contacted, a non-loopback `--host` is refused at startup.
//! - With a secret: P/D through the proxy equals one instance; unsigned, edited or expired params
//!   are refused before any connection (401/403, counted by reason); the handshake answers only
//!   signed requests; a released lease frees its blocks at once.

mod common;

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::Server;
use serde_json::{json, Value};

const PRODUCER: &str = r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer"}"#;
const SECRET: &str = "tandem-test-deployment-secret";

fn consumer(extra: &str) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":"recompute"{extra}}}"#
    )
}

async fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

async fn greedy(base: &str, prompt: &str, params: Option<&Value>) -> (u16, Value) {
    let mut body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0});
    if let Some(p) = params {
        body["kv_transfer_params"] = p.clone();
    }
    post(base, "/v1/completions", &body).await
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

const VICTIM: &str = "Note for the night shift. The vault code is SWORDFISH. Repeat it to nobody. \
                      Again, the vault code is";
const ATTACKER: &str =
    "Note for the night shift. The vault code is REDACTED. Repeat it to nobody. \
                        Again, the vault code is";

/// The attack that worked before leases were claimed: a client reaches the decode instance
/// directly with params naming the producer's engine and the victim's block ids, with an id of
/// its own and no checksums. The producer refuses the claim, nothing is read, and the consumer
/// recomputes the attacker's own prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_skipping_the_proxy_reads_no_other_requests_kv() {
    let single = Server::serve(&[]);
    let producer = Server::serve(&["--kv-transfer-config", PRODUCER]);
    let decode = Server::serve(&["--kv-transfer-config", &consumer("")]);
    let (_, victim_alone) = greedy(&single.base, VICTIM, None).await;
    assert!(
        text(&victim_alone).contains("SWORDFISH"),
        "the model repeats the code: {victim_alone}"
    );
    let (_, attacker_alone) = greedy(&single.base, ATTACKER, None).await;
    assert!(!text(&attacker_alone).contains("SWORDFISH"));

    // The victim's request, prefilled and waiting for its consumer.
    let victim = common::prefill_params(&producer, VICTIM).await;
    // The engine id is public: the handshake serves it on loopback without a secret.
    let hs: Value = reqwest::get(producer.url("/v1/kv/handshake"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut attack = json!({"do_remote_prefill": true, "remote_engine_id": hs["engine_id"],
        "remote_request_id": "1-0123456789abcdef0123456789abcdef",
        "remote_block_ids": victim["remote_block_ids"], "remote_host": "127.0.0.1",
        "remote_port": producer.port, "tp_size": 1});
    let (st, v) = greedy(&decode.base, ATTACKER, Some(&attack)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        text(&v),
        text(&attacker_alone),
        "recomputed, not decoded from the victim's KV"
    );
    assert!(!text(&v).contains("SWORDFISH"), "{v}");
    // The victim's own id, if an attacker ever learned it, is single-use: the victim's consumer
    // claimed... here nobody did yet, so a guessed-right id with edited blocks is refused too.
    attack["remote_request_id"] = victim["remote_request_id"].clone();
    let mut blocks = victim["remote_block_ids"].as_array().unwrap().clone();
    blocks.reverse();
    attack["remote_block_ids"] = json!(blocks);
    let (st, v) = greedy(&decode.base, ATTACKER, Some(&attack)).await;
    assert_eq!(st, 200, "{v}");
    assert!(!text(&v).contains("SWORDFISH"), "{v}");
    assert_eq!(
        producer
            .metric("tandem:kv_transfer_refused_total", &[("reason", "lease")])
            .await,
        Some(2.0)
    );
    assert_eq!(
        decode
            .metric("tandem:kv_load_failures_total", &[("policy", "recompute")])
            .await,
        Some(2.0)
    );
    // The victim's real consumer still gets its KV.
    let (st, v) = greedy(&decode.base, VICTIM, Some(&victim)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(text(&v), text(&victim_alone));
    common::wait_all_free(&[&producer, &decode]).await;
}

/// `remote_block_size` decides how the consumer plans its READ; the producer's handshake decides
/// how the transfer pairs blocks. A client holding real params that edits the block size (with a
/// prompt of matching length, so the params still parse) is refused before the claim: its READ
/// would land in other blocks of the consumer, and the single-use lease stays the victim's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn params_naming_another_producer_block_size_are_refused_before_the_claim() {
    let producer = Server::serve(&["--kv-transfer-config", PRODUCER]);
    let decode = Server::serve(&["--kv-transfer-config", &consumer("")]);
    let victim = common::prefill_params(&producer, VICTIM).await;
    let n = victim["remote_block_ids"].as_array().unwrap().len();
    let mut forged = victim.clone();
    forged["remote_block_size"] = json!(8);
    // 8 n tokens fill n blocks of 8: the edited params are well formed.
    let prompt: Vec<u32> = (0..8 * n as u32).map(|i| 100 + i % 50).collect();
    let (st, v) = post(
        &decode.base,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2, "temperature": 0,
                "kv_transfer_params": forged}),
    )
    .await;
    assert_eq!(st, 200, "recomputed: {v}");
    assert!(
        decode
            .log_text()
            .contains("kv_transfer_params say the producer's blocks hold Some(8) tokens"),
        "the READ was not refused for its block size"
    );
    // The victim's consumer still claims its lease and loads.
    let (st, v) = greedy(&decode.base, VICTIM, Some(&victim)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        decode
            .metric("tandem:kv_load_failures_total", &[("policy", "recompute")])
            .await,
        Some(1.0),
        "only the forged load failed"
    );
    common::wait_all_free(&[&producer, &decode]).await;
}

/// Params naming a producer outside `allowed_producers` (loopback only, by default without a
/// secret) are refused before any connection: no SSRF, no blocks held while a host never answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_outside_the_allowlist_are_never_contacted() {
    let trap = TcpListener::bind("127.0.0.1:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let trap_port = trap.local_addr().unwrap().port();
    let only_other = format!(
        r#","kv_connector_extra_config":{{"allowed_producers":["127.0.0.1:{}"]}}"#,
        trap_port.wrapping_add(1).max(1)
    );
    let defaults = Server::serve(&["--kv-transfer-config", &consumer("")]);
    let listed = Server::serve(&["--kv-transfer-config", &consumer(&only_other)]);
    let params = |host: &str, port: u16| {
        json!({"do_remote_prefill": true, "remote_engine_id": "p", "remote_request_id": "r",
               "remote_block_ids": [0], "remote_host": host, "remote_port": port, "tp_size": 1})
    };
    for (server, host, port) in [
        (&defaults, "10.255.255.1", 8100),
        (&defaults, "169.254.169.254", 80),
        (&defaults, "example.com", 8100),
        (&listed, "127.0.0.1", trap_port),
    ] {
        let started = Instant::now();
        let (st, v) = greedy(&server.base, "Hi", Some(&params(host, port))).await;
        assert_eq!(st, 403, "{host}:{port}: {v}");
        assert_eq!(v["error"]["param"], "kv_transfer_params", "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("allowed_producers"), "{msg}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "refused at once"
        );
    }
    assert!(trap.accept().is_err(), "the refused producer was contacted");
    assert_eq!(
        defaults
            .metric(
                "tandem:kv_transfer_refused_total",
                &[("reason", "producer_not_allowed")]
            )
            .await,
        Some(3.0)
    );
    common::wait_all_free(&[&defaults, &listed]).await;
}

/// A P/D instance without a secret may not listen beyond loopback.
#[test]
fn a_non_loopback_host_without_a_secret_is_refused_at_startup() {
    common::require_model();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["serve", "--host", "0.0.0.0", "--port", "1"])
        .args(["--kv-transfer-config", PRODUCER])
        .env_remove("TANDEM_KV_TRANSFER_SECRET")
        .current_dir(common::repo_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("loopback only") && err.contains("--kv-transfer-secret-file"),
        "{err}"
    );
    // A secret that is too short is refused too, naming the flag.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("secret");
    std::fs::write(&file, "short\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["serve", "--port", "1", "--kv-transfer-config", PRODUCER])
        .arg("--kv-transfer-secret-file")
        .arg(&file)
        .current_dir(common::repo_root())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at least 16 bytes"), "{err}");
}

/// With a deployment secret: the real path works, and everything unsigned is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_secret_only_signed_params_and_peers_move_kv() {
    let env = [("TANDEM_KV_TRANSFER_SECRET", SECRET)];
    let short_lease = r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"kv_lease_duration":1}}"#;
    let producer = Server::start("serve", &["--kv-transfer-config", PRODUCER], &env);
    let slow = Server::start("serve", &["--kv-transfer-config", short_lease], &env);
    let decode = Server::start("serve", &["--kv-transfer-config", &consumer("")], &env);
    let single = Server::serve(&[]);
    let prompt = "The capital of France is";
    let (_, alone) = greedy(&single.base, prompt, None).await;

    let signed = common::prefill_params(&producer, prompt).await;
    assert!(signed["signature"].is_string(), "{signed}");
    assert!(signed["expires_at"].is_u64(), "{signed}");
    let (st, v) = greedy(&decode.base, prompt, Some(&signed)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(text(&v), text(&alone));
    assert_eq!(
        decode.metric_total("tandem:kv_load_failures_total").await,
        0.0,
        "loaded, not recomputed"
    );

    // Unsigned, edited, replayed-elsewhere and expired params: refused before any connection.
    let fresh = common::prefill_params(&producer, prompt).await;
    let mut unsigned = fresh.clone();
    unsigned.as_object_mut().unwrap().remove("signature");
    let mut edited = fresh.clone();
    edited["remote_block_ids"] = json!([0]);
    let mut moved = fresh.clone();
    moved["remote_port"] = json!(1);
    for (params, status) in [(&unsigned, 401), (&edited, 401), (&moved, 401)] {
        let (st, v) = greedy(&decode.base, prompt, Some(params)).await;
        assert_eq!(st, status, "{params}: {v}");
        assert_eq!(v["error"]["param"], "kv_transfer_params");
    }
    let expiring = common::prefill_params(&slow, prompt).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (st, v) = greedy(&decode.base, prompt, Some(&expiring)).await;
    assert_eq!(st, 403, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("expired"));
    assert_eq!(
        decode
            .metric(
                "tandem:kv_transfer_refused_total",
                &[("reason", "unauthorized")]
            )
            .await,
        Some(3.0)
    );
    assert_eq!(
        decode
            .metric("tandem:kv_transfer_refused_total", &[("reason", "expired")])
            .await,
        Some(1.0)
    );

    // The handshake carries the NIXL metadata: signed requests only.
    let r = reqwest::get(producer.url("/v1/kv/handshake"))
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    // The proxy's release frees an unclaimed lease now, not at expiry; a claim after it fails.
    let (st, v) = post(
        &producer.base,
        "/v1/kv/release",
        &json!({"kv_transfer_params": fresh}),
    )
    .await;
    assert_eq!((st, v["release"].as_str()), (200, Some("released")), "{v}");
    let freed = Instant::now();
    common::wait_all_free(&[&producer]).await;
    assert!(freed.elapsed() < Duration::from_secs(5));
    assert_eq!(
        producer.metric("tandem:kv_lease_expired_total", &[]).await,
        Some(0.0)
    );
    let (st, v) = post(
        &producer.base,
        "/v1/kv/claim",
        &json!({"kv_transfer_params": fresh}),
    )
    .await;
    assert_eq!(st, 409, "{v}");
    // A release with unsigned params is refused and frees nothing.
    let held = common::prefill_params(&producer, prompt).await;
    let mut forged = held.clone();
    forged.as_object_mut().unwrap().remove("signature");
    let (st, _) = post(
        &producer.base,
        "/v1/kv/release",
        &json!({"kv_transfer_params": forged}),
    )
    .await;
    assert_eq!(st, 401);
    let (st, v) = greedy(&decode.base, prompt, Some(&held)).await;
    assert_eq!((st, text(&v)), (200, text(&alone)));
    common::wait_all_free(&[&producer, &slow, &decode]).await;
}
