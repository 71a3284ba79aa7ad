//! Tensor- and pipeline-parallel instances end to end: `tandem serve --tensor-parallel-size N
//! --pipeline-parallel-size M` answers what a TP 1 instance answers (greedy, f32), under
//! concurrent requests with chunked prefill, and frees every block; layouts that do not split
//! are refused at startup with the reason.

mod common;

use std::process::Command;

use common::{post, require_model, wait_all_free, Server};
use futures::future::join_all;
use serde_json::{json, Value};

/// A flip is accepted only where the TP 1 instance's top-two logprob margin is under this.
const NEAR_TIE: f64 = 0.1;

const PROMPTS: &[&str] = &[
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours of the rainbow:",
    "In 1969, the first humans",
    "Water boils at a temperature of",
    "The quick brown fox",
];

/// Greedy completions of every prompt at once, with each step's top-two logprobs.
async fn greedy_all(server: &Server, max_tokens: usize) -> Vec<(Vec<u64>, Vec<f64>)> {
    let reqs = PROMPTS.iter().map(|p| async move {
        let (st, v) = post(
            &server.base,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
                    "return_token_ids": true, "ignore_eos": true}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        let ids = common::ids(&v);
        let margins = v["choices"][0]["logprobs"]["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|top| {
                let mut lp: Vec<f64> = top
                    .as_object()
                    .unwrap()
                    .values()
                    .map(|x| x.as_f64().unwrap())
                    .collect();
                lp.sort_by(|a, b| b.total_cmp(a));
                // one entry when the top two decode to the same text: no margin known
                if lp.len() > 1 {
                    lp[0] - lp[1]
                } else {
                    0.0
                }
            })
            .collect();
        (ids, margins)
    });
    join_all(reqs).await
}

/// Greedy ids of `got` equal `want`'s up to a near-tie flip (then the comparison of that prompt
/// stops); returns the number of matched tokens.
fn assert_same_answers(
    want: &[(Vec<u64>, Vec<f64>)],
    got: &[(Vec<u64>, Vec<f64>)],
    what: &str,
) -> usize {
    let mut matched = 0;
    for (i, ((w, margins), (g, _))) in want.iter().zip(got).enumerate() {
        match w.iter().zip(g).position(|(a, b)| a != b) {
            None => matched += w.len(),
            Some(s) => {
                assert!(
                    margins[s] < NEAR_TIE,
                    "{what}: prompt {i} step {s}: token {} instead of {} (TP 1 margin {})",
                    g[s],
                    w[s],
                    margins[s]
                );
                eprintln!("{what}: prompt {i}: near-tie flip at step {s}");
                matched += s;
            }
        }
    }
    matched
}

const SMALL_CACHE: &[&str] = &[
    "--dtype",
    "f32",
    "--num-kv-blocks",
    "256",
    "--max-num-batched-tokens",
    "24",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp3_and_pp2_instances_answer_as_tp1_and_free_every_block() {
    require_model();
    let tp1 = Server::serve(SMALL_CACHE);
    let want = greedy_all(&tp1, 16).await;
    drop(tp1);
    for (tp, pp) in [("3", "1"), ("3", "2")] {
        let mut args = SMALL_CACHE.to_vec();
        args.extend(["--tensor-parallel-size", tp, "--pipeline-parallel-size", pp]);
        let server = Server::serve(&args);
        let got = greedy_all(&server, 16).await;
        let matched = assert_same_answers(&want, &got, &format!("TP {tp} PP {pp}"));
        assert!(
            matched >= 80,
            "TP {tp} PP {pp}: {matched} of 96 tokens matched"
        );
        wait_all_free(&[&server]).await;
        let log = server.log_text();
        assert!(log.contains(&format!("tp={tp} pp={pp}")), "{log}");
        let last = [
            ("tp_rank", "2"),
            ("pp_rank", if pp == "2" { "1" } else { "0" }),
        ];
        let waited = server
            .metric("tandem:parallel_collective_seconds", &last)
            .await
            .expect("the collectives metric of the last rank");
        assert!(waited > 0.0, "TP {tp} PP {pp}: no time in collectives");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dummy_model_with_replicated_kv_heads_serves_at_tp4() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::dummy_gqa_config(dir.path());
    let config = config.as_str();
    let base = [
        "--load-format",
        "dummy",
        "--model-config",
        config,
        "--dtype",
        "f32",
    ];
    let tp1 = Server::start("serve", &base, &[]);
    let (st, models) = get_json(&tp1.base, "/v1/models").await;
    assert_eq!(st, 200);
    assert_eq!(
        models["data"][0]["id"], "gqa-8x2",
        "the config's stem names it"
    );
    let want = greedy_all(&tp1, 12).await;
    assert!(
        tp1.metric("tandem:num_requests_running", &[("model_name", "gqa-8x2")])
            .await
            .is_some(),
        "the metrics are labelled with the served name"
    );
    drop(tp1);
    let mut args = base.to_vec();
    args.extend(["--tensor-parallel-size", "4"]);
    let tp4 = Server::start("serve", &args, &[]);
    let got = greedy_all(&tp4, 12).await;
    let matched = assert_same_answers(&want, &got, "dummy TP 4");
    assert!(matched >= 60, "{matched} of 72 tokens matched");
    wait_all_free(&[&tp4]).await;
}

async fn get_json(base: &str, path: &str) -> (u16, Value) {
    let r = common::client()
        .get(format!("{base}{path}"))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// Runs `tandem serve ARGS` expecting it to exit at startup; returns its output.
fn refused(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("serve")
        .args(args)
        .args(["--port", "1"])
        .current_dir(common::repo_root())
        .output()
        .unwrap();
    assert!(!out.status.success(), "tandem serve {args:?} started");
    String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout)
}

#[test]
fn layouts_and_flags_that_cannot_work_are_refused_at_startup() {
    require_model();
    let e = refused(&["--tensor-parallel-size", "2"]);
    assert!(
        e.contains("attention heads (9)") && e.contains("(2)"),
        "{e}"
    );
    let e = refused(&["--tensor-parallel-size", "0"]);
    assert!(e.contains("at least 1"), "{e}");
    let e = refused(&["--pipeline-parallel-size", "31"]);
    assert!(e.contains("pipeline stages"), "{e}");
    let e = refused(&["--load-format", "dummy"]);
    assert!(e.contains("--model-config"), "{e}");
    let e = refused(&["--model-config", "x.json"]);
    assert!(e.contains("--load-format dummy"), "{e}");
    let e = refused(&["--load-format", "pt"]);
    assert!(e.contains("expected auto or dummy"), "{e}");
    let e = refused(&[
        "--tensor-parallel-size",
        "3",
        "--kv-transfer-config",
        r#"{"kv_connector":"NixlPushConnector","kv_role":"kv_producer"}"#,
    ]);
    assert!(e.contains("push mode") && e.contains("pull mode"), "{e}");
    let e = refused(&["--kv-cache-layout", "nhd"]);
    assert!(e.contains("token_major or head_major"), "{e}");
}
