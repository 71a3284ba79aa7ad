//! The official `openai` Python client (installed by `scripts/setup.sh` into `.tools/python`)
//! against a real instance (with an API key) and against the P/D proxy in front of a real
//! producer and consumer: `tests/openai/client_check.py` runs every check and fails on the first
//! that does not hold (chat and completions, streaming with usage, logprobs, `n`, `stop`, seeds,
//! `logit_bias` and the penalties, errors by exception type with the field named).

mod common;

use std::process::Command;

use common::{repo_root, Server};

/// `pd`: `base` is the P/D proxy (requests that need the prompt computed locally are refused).
fn run_client_checks(base: &str, api_key: Option<&str>, pd: bool) {
    let python = repo_root().join(".tools/python");
    assert!(
        python.join("openai").exists(),
        "the openai client is missing: run scripts/setup.sh"
    );
    let mut cmd = Command::new("python3");
    cmd.arg(repo_root().join("tests/openai/client_check.py"))
        .arg(base)
        .env("PYTHONPATH", &python)
        .env("TANDEM_CHECK_PD", if pd { "1" } else { "0" });
    if let Some(k) = api_key {
        cmd.arg(k);
    }
    let out = cmd.output().expect("run python3");
    assert!(
        out.status.success(),
        "client checks failed against {base}:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_openai_client_against_an_instance() {
    let s = Server::serve(&["--api-key", "sk-tandem-test"]);
    run_client_checks(&s.base, Some("sk-tandem-test"), false);
}

#[test]
fn the_openai_client_through_the_pd_proxy() {
    common::require_model();
    let prefill = Server::serve(&[
        "--kv-transfer-config",
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer","enable_kv_checksum":true}"#,
    ]);
    let decode = Server::serve(&[
        "--kv-transfer-config",
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","enable_kv_checksum":true,"kv_checksum_fail_closed":true}"#,
    ]);
    let proxy = Server::start(
        "proxy",
        &["--prefill", &prefill.base, "--decode", &decode.base],
        &[],
    );
    run_client_checks(&proxy.base, None, true);
}
