//! End-to-end: the engine of a real `tandem serve` dies and the server stays sane.
//!
//! `TANDEM_DEBUG_ENGINE_FAULT=panic_at_step:N` makes the engine's worker panic in its N-th model
//! step. Two requests are in flight when it does: the non-streamed one gets a 500 envelope, the
//! streamed one an error event, then `[DONE]`, then the end of the stream. Afterwards `/health`
//! and new requests answer 503 with the envelope, `/metrics` still answers (nothing running,
//! every block free, both requests counted as errors), and the process is still up.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{sse_events, Server};
use serde_json::{json, Value};

/// The model step that panics: late enough that both requests below were submitted and run.
const FAULT: &str = "panic_at_step:40";

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

/// Asserts an OpenAI error envelope with `code` and `kind`.
fn assert_envelope(body: &Value, code: u16, kind: &str) {
    let e = &body["error"];
    for k in ["message", "type", "param", "code"] {
        assert!(e.get(k).is_some(), "envelope lacks {k}: {body}");
    }
    assert_eq!(e["code"], json!(code), "{body}");
    assert_eq!(e["type"], json!(kind), "{body}");
    assert!(!e["message"].as_str().unwrap().is_empty(), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_fails_its_requests_answers_503_and_keeps_serving_metrics() {
    common::require_model();
    let mut s = Server::start("serve", &[], &[("TANDEM_DEBUG_ENGINE_FAULT", FAULT)]);
    assert!(
        s.log_text()
            .contains(&format!("TANDEM_DEBUG_ENGINE_FAULT={FAULT}")),
        "the fault is announced in the log:\n{}",
        s.log_text()
    );
    let c = client();
    let long = json!({"max_tokens": 400, "ignore_eos": true, "temperature": 0});
    let mut streamed = long.clone();
    streamed["prompt"] = json!("Once upon a time, in a small village,");
    streamed["stream"] = json!(true);
    let mut chat = long;
    chat["messages"] = json!([{"role": "user", "content": "Tell me a long story."}]);
    let (streamed, chat) = tokio::join!(
        async {
            let r = c
                .post(s.url("/v1/completions"))
                .json(&streamed)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), sse_events(r).await)
        },
        async {
            let r = c
                .post(s.url("/v1/chat/completions"))
                .json(&chat)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        },
    );

    // The non-streamed request: a 500 envelope that does not leak the panic.
    let (status, body) = chat;
    assert_eq!(status, 500, "{body}");
    assert_envelope(&body, 500, "InternalServerError");
    assert!(!body.to_string().contains("deliberate"), "{body}");

    // The streamed one: tokens, then one error event, then [DONE], then the end.
    let (status, events) = streamed;
    assert_eq!(status, 200, "the stream had started");
    assert!(events.len() >= 3, "{events:?}");
    assert_eq!(events.last().unwrap(), "[DONE]", "{events:?}");
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_envelope(&error, 500, "InternalServerError");
    for e in &events[..events.len() - 2] {
        let chunk: Value = serde_json::from_str(e).unwrap();
        assert!(chunk.get("error").is_none(), "one error event: {events:?}");
        assert_eq!(chunk["choices"][0]["finish_reason"], Value::Null, "{e}");
    }

    // Health and new requests: 503 with the envelope, streamed or not.
    let r = c.get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert_envelope(&r.json().await.unwrap(), 503, "ServiceUnavailableError");
    for stream in [false, true] {
        let r = c
            .post(s.url("/v1/completions"))
            .json(&json!({"prompt": "Hello", "max_tokens": 4, "stream": stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 503, "stream: {stream}");
        assert_envelope(&r.json().await.unwrap(), 503, "ServiceUnavailableError");
    }

    // Metrics still answer and say what happened; the process is still up.
    common::wait_all_free(&[&s]).await;
    let errors = s
        .metric(
            "tandem:request_success_total",
            &[("finished_reason", "error")],
        )
        .await;
    assert_eq!(errors, Some(2.0));
    assert!(
        s.child.try_wait().unwrap().is_none(),
        "the process is still running"
    );
    assert!(s.log_text().contains("engine step panicked"));
}

#[test]
fn a_malformed_engine_fault_stops_startup_with_a_clear_error() {
    common::require_model();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["serve", "--host", "127.0.0.1", "--port"])
        .arg(common::free_port().to_string())
        .current_dir(common::repo_root())
        .env("TANDEM_DEBUG_ENGINE_FAULT", "panic_at_step:zero")
        .stdin(Stdio::null())
        .output()
        .expect("run tandem");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("TANDEM_DEBUG_ENGINE_FAULT=`panic_at_step:zero`"),
        "{stderr}"
    );
}
