//! End-to-end tests of one instance: the real `tandem serve` binary on the real default model,
//! driven over HTTP.

mod common;

use std::time::Duration;

use common::{sse_events, Server};
use futures::StreamExt;
use serde_json::{json, Value};

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

async fn post(s: &Server, path: &str, body: Value) -> (u16, Value) {
    let r = client().post(s.url(path)).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn get_json(s: &Server, path: &str) -> Value {
    let r = client().get(s.url(path)).send().await.unwrap();
    r.json().await.unwrap()
}

/// `body` streamed to `path`: the JSON of every SSE event before `[DONE]`.
async fn stream_json(s: &Server, path: &str, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = client().post(s.url(path)).json(&body).send().await.unwrap();
    sse_events(r)
        .await
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

async fn complete_ids(s: &Server, prompt: &str, max_tokens: usize) -> Vec<u64> {
    let (st, body) = post(
        s,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": true}),
    )
    .await;
    assert_eq!(st, 200, "{body}");
    body["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_answers_and_reports_usage() {
    let s = Server::serve(&[]);
    // The f32 reference answers "The capital of France is Paris." with top-two margins of 1.48
    // logits or more up to "Paris", so the default Q8_0 weights must too. (Without "Answer in one
    // sentence." the first token wins by only 0.08 logits, a near-tie that quantized weights
    // flip, see models/src/weights.rs.)
    let (st, body) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "smollm2-135m", "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}], "max_tokens": 24, "temperature": 0}),
    )
    .await;
    assert_eq!(st, 200, "{body}");
    let text = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text}");
    assert_eq!(body["object"], "chat.completion");
    let u = &body["usage"];
    assert!(u["prompt_tokens"].as_u64().unwrap() > 10);
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    assert!(body.get("kv_transfer_params").is_some());
    let (st, models) = (
        200,
        reqwest::get(s.url("/v1/models"))
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap(),
    );
    assert_eq!(st, 200);
    assert_eq!(models["data"][0]["id"], "smollm2-135m");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_greedy_requests_equal_their_solo_outputs() {
    let s = Server::serve(&[]);
    let mut solo = Vec::new();
    for p in PROMPTS {
        solo.push(complete_ids(&s, p, 24).await);
    }
    // 16 concurrent requests, 4 of each prompt.
    let futs = (0..16).map(|i| {
        let s = &s;
        async move { (i % 4, complete_ids(s, PROMPTS[i % 4], 24).await) }
    });
    let results = futures::future::join_all(futs).await;
    for (p, ids) in results {
        assert_eq!(ids, solo[p], "prompt {p} changed under batching");
    }
    // every block free again, no request left (gauges are published at the end of a step,
    // which may come just after the last answer)
    common::wait_all_free(&[&s]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_hit_equals_miss() {
    let s = Server::serve(&[]);
    let prompt = "In the beginning of the twentieth century, the city grew quickly as factories opened along the river and workers arrived from the countryside. Describe";
    let body =
        json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": true});
    let (_, miss) = post(&s, "/v1/completions", body.clone()).await;
    let (_, hit) = post(&s, "/v1/completions", body).await;
    assert_eq!(miss["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(
        hit["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 16
    );
    assert_eq!(
        miss["choices"][0]["token_ids"],
        hit["choices"][0]["token_ids"]
    );
    assert!(
        s.metric("tandem:prefix_cache_hits_total", &[])
            .await
            .unwrap()
            >= 16.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_matches_non_streaming() {
    let s = Server::serve(&[]);
    let body = json!({"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0});
    let (_, full) = post(&s, "/v1/completions", body.clone()).await;
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let resp = client()
        .post(s.url("/v1/completions"))
        .json(&sbody)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let events = sse_events(resp).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let mut text = String::new();
    let mut finish = None;
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(c) = v["choices"].as_array().and_then(|c| c.first()) {
            text.push_str(c["text"].as_str().unwrap_or(""));
            if !c["finish_reason"].is_null() {
                finish = Some(c["finish_reason"].clone());
            }
        }
        if !v["usage"].is_null() {
            usage = Some(v["usage"].clone());
        }
    }
    assert!(events.len() > 5, "streamed token by token");
    assert_eq!(text, full["choices"][0]["text"].as_str().unwrap());
    assert_eq!(finish, Some(json!("length")));
    assert_eq!(usage.unwrap()["completion_tokens"], 20);

    // chat streaming: role first, then content deltas
    let resp = client()
        .post(s.url("/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "stream": true, "temperature": 0}))
        .send()
        .await
        .unwrap();
    let events = sse_events(resp).await;
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(first["object"], "chat.completion.chunk");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_end_the_text_and_are_not_emitted() {
    let s = Server::serve(&[]);
    let body = json!({"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0});
    let (_, free) = post(&s, "/v1/completions", body.clone()).await;
    let text = free["choices"][0]["text"].as_str().unwrap().to_string();
    // pick a word from the middle of the free output as the stop string
    let words: Vec<&str> = text.split_whitespace().collect();
    assert!(words.len() >= 3, "{text}");
    let stop = words[2].to_string();
    let mut b = body.clone();
    b["stop"] = json!([stop]);
    let (_, stopped) = post(&s, "/v1/completions", b).await;
    let out = stopped["choices"][0]["text"].as_str().unwrap();
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(stopped["choices"][0]["stop_reason"], json!(stop));
    assert_eq!(out, &text[..text.find(&stop).unwrap()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_envelopes_and_break_nothing() {
    let s = Server::serve(&[
        "--max-model-len",
        "256",
        "--max-request-body-bytes",
        "100000",
    ]);
    let c = client();
    let raw = |body: &'static str| {
        let c = c.clone();
        let url = s.url("/v1/completions");
        async move {
            let r = c
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let cases: Vec<(u16, Value)> = vec![
        raw("{not json").await,
        raw("[1,2,3]").await,
        raw(r#"{"prompt": 5}"#).await,
        raw(r#"{"prompt": "hi", "max_tokens": "many"}"#).await,
    ];
    // JSON of the wrong shape is a 400 (vLLM's status) naming the field, in JSON's words
    let expected = [
        (400, None),
        (400, None),
        (400, Some("prompt")),
        (400, Some("max_tokens")),
    ];
    for ((st, body), (want, param)) in cases.iter().zip(expected) {
        assert_eq!(*st, want, "{body}");
        assert_eq!(body["error"]["param"].as_str(), param, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            !message.contains("usize") && !message.contains("untagged"),
            "{message}"
        );
        let e = &body["error"];
        for k in ["message", "type", "param", "code"] {
            assert!(e.get(k).is_some(), "envelope lacks {k}: {body}");
        }
    }
    let (st, body) = post(
        &s,
        "/v1/completions",
        json!({"model": "gpt-9", "prompt": "hi"}),
    )
    .await;
    assert_eq!((st, body["error"]["param"].clone()), (404, json!("model")));
    let long = "word ".repeat(400);
    let (st, body) = post(
        &s,
        "/v1/completions",
        json!({"prompt": long, "max_tokens": 10}),
    )
    .await;
    assert_eq!(st, 400);
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("maximum context length is 256"), "{msg}");
    for (field, value) in [
        ("temperature", json!(-1)),
        ("top_p", json!(0)),
        ("top_k", json!(-5)),
        ("n", json!(0)),
        ("max_tokens", json!(0)),
        // Sizes near 2^64 must not wrap the length check (they did in release builds).
        ("max_tokens", json!(u64::MAX)),
        ("min_tokens", json!(u64::MAX)),
        ("logprobs", json!(50)),
    ] {
        let mut b = json!({"prompt": "hi", "max_tokens": 4});
        b[field] = value;
        let (st, body) = post(&s, "/v1/completions", b).await;
        assert_eq!(st, 400, "{field}: {body}");
        assert_eq!(body["error"]["param"], json!(field), "{body}");
    }
    // Just below the wrap: an honest context-length error.
    let (st, body) = post(
        &s,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": u64::MAX - 2}),
    )
    .await;
    assert_eq!(st, 400, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length is 256"));
    let (st, _) = post(
        &s,
        "/v1/completions",
        json!({"prompt": [1, 2, 99999999], "max_tokens": 2}),
    )
    .await;
    assert_eq!(st, 400);
    let (st, _) = post(&s, "/v1/chat/completions", json!({"messages": []})).await;
    assert_eq!(st, 400);
    let (st, _) = post(
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "wizard", "content": "x"}]}),
    )
    .await;
    assert_eq!(st, 400);
    let (st, _) = post(
        &s,
        "/v1/completions",
        json!({"prompt": "hi", "kv_transfer_params": 7}),
    )
    .await;
    assert_eq!(st, 400);
    let big = "x".repeat(200_000);
    let r = c
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": big}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 413);
    // The server closes a connection whose oversized body it did not read: use a new one.
    let r = client().get(s.url("/v2/nothing")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    // still serving, nothing leaked
    assert_eq!(complete_ids(&s, "Hello", 4).await.len(), 4);
    assert_eq!(common::http_get_status(&s.url("/health")), Some(200));
    // (the gauges are published at the engine's next step boundary, just after the answer)
    common::wait_all_free(&[&s]).await;
}

/// No field that would change the output is accepted and ignored: the ones Tandem does not
/// implement are refused with a 400 naming them, on both routes; fields that change nothing and
/// unknown fields are accepted (an unknown name is logged once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_that_would_change_the_output_are_refused_by_name() {
    let s = Server::serve(&[]);
    for (route, base) in [
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 2})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ),
    ] {
        for (field, value) in [
            ("allowed_token_ids", json!([100])),
            ("response_format", json!({"type": "yaml"})),
            (
                "tools",
                json!([{"type": "function", "function": {"name": "f g", "parameters": {}}}]),
            ),
            ("tool_choice", json!("sometimes")),
            ("typical_p", json!(0.5)),
            ("guided_json", json!([1])),
            ("guided_regex", json!("[a-z")),
            ("guided_choice", json!([])),
            ("guided_grammar", json!("root ::= \"a\"")),
            ("functions", json!([{"name": "f"}])),
        ] {
            let mut b = base.clone();
            b[field] = value;
            let (st, body) = post(&s, route, b).await;
            assert_eq!(st, 400, "{route} {field}: {body}");
            assert_eq!(body["error"]["param"], json!(field), "{body}");
            assert_eq!(body["error"]["type"], json!("BadRequestError"), "{body}");
        }
        // neutral values, no-op fields and unknown fields: 200
        let mut b = base.clone();
        for (field, value) in [
            ("best_of", json!(1)),
            ("response_format", json!({"type": "text"})),
            ("tool_choice", json!("none")),
            ("user", json!("u-1")),
            ("metadata", json!({"team": "a"})),
            ("store", json!(false)),
            ("a_field_nobody_knows", json!(3)),
        ] {
            b[field] = value;
        }
        let (st, body) = post(&s, route, b.clone()).await;
        assert_eq!(st, 200, "{route}: {body}");
        let (st, _) = post(&s, route, b).await;
        assert_eq!(st, 200);
    }
    let log = s.log_text();
    assert_eq!(
        log.matches("\"a_field_nobody_knows\" is not known").count(),
        1,
        "one warning per unknown field name:\n{log}"
    );
    common::wait_all_free(&[&s]).await;
}

/// vLLM's utility routes and response details: `/tokenize` gives exactly the ids the generation
/// routes use, `/detokenize` inverts it and refuses ids outside the vocabulary, `/version`,
/// `/v1/models` with `root` and `created`, and `X-Request-Id` on every generation response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_detokenize_version_models_and_request_ids() {
    let s = Server::serve(&[]);
    let text = "The capital of France is";
    let (st, tok) = post(
        &s,
        "/tokenize",
        json!({"prompt": text, "return_token_strs": true}),
    )
    .await;
    assert_eq!(st, 200, "{tok}");
    let (_, gen) = post(
        &s,
        "/v1/completions",
        json!({"prompt": text, "max_tokens": 1, "return_token_ids": true}),
    )
    .await;
    assert_eq!(tok["tokens"], gen["prompt_token_ids"], "{tok} {gen}");
    assert_eq!(tok["count"], json!(tok["tokens"].as_array().unwrap().len()));
    assert!(tok["max_model_len"].as_u64().unwrap() > 0);
    let strs: String = tok["token_strs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(strs.replace('Ġ', " ").contains("France"), "{strs}");
    let messages = json!([{"role": "user", "content": "Hi there"}]);
    let (_, chat_tok) = post(&s, "/tokenize", json!({"messages": messages})).await;
    let (_, chat) = post(
        &s,
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 1, "return_token_ids": true}),
    )
    .await;
    assert_eq!(
        chat_tok["tokens"], chat["prompt_token_ids"],
        "{chat_tok} {chat}"
    );
    let (st, de) = post(&s, "/detokenize", json!({"tokens": tok["tokens"]})).await;
    assert_eq!(st, 200);
    assert_eq!(de["prompt"], json!(text));
    for (path, body, param) in [
        ("/detokenize", json!({"tokens": [1, 999999999]}), "tokens"),
        (
            "/tokenize",
            json!({"prompt": "a", "messages": messages}),
            "prompt",
        ),
        (
            "/tokenize",
            json!({"prompt": "a", "add_special_tokens": false}),
            "add_special_tokens",
        ),
        (
            "/tokenize",
            json!({"model": "other", "prompt": "a"}),
            "model",
        ),
    ] {
        let (st, e) = post(&s, path, body).await;
        assert!(st == 400 || st == 404, "{path}: {st} {e}");
        assert_eq!(e["error"]["param"], json!(param), "{e}");
    }
    let v = get_json(&s, "/version").await;
    assert!(v["version"].as_str().is_some_and(|v| !v.is_empty()), "{v}");
    let m = get_json(&s, "/v1/models").await;
    let card = &m["data"][0];
    assert!(card["root"].as_str().unwrap().ends_with(".gguf"), "{card}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let created = card["created"].as_u64().unwrap();
    assert!(created <= now && now - created < 600, "{card}");
    // X-Request-Id: the client's echoed, else one generated, streaming or not
    for stream in [false, true] {
        let r = client()
            .post(s.url("/v1/completions"))
            .header("x-request-id", "client-id-7")
            .json(&json!({"prompt": "Hi", "max_tokens": 2, "stream": stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.headers()["x-request-id"],
            "client-id-7",
            "stream {stream}"
        );
        let r = client()
            .post(s.url("/v1/completions"))
            .json(&json!({"prompt": "Hi", "max_tokens": 2, "stream": stream}))
            .send()
            .await
            .unwrap();
        let id = r.headers()["x-request-id"].to_str().unwrap().to_string();
        let body = r.text().await.unwrap();
        assert!(
            body.contains(&id),
            "the body's id names the request: {id} {body}"
        );
    }
    common::wait_all_free(&[&s]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_frees_blocks() {
    let s = Server::serve(&[]);
    let total = s.metric("tandem:kv_cache_total_blocks", &[]).await.unwrap();
    let resp = client()
        .post(s.url("/v1/completions"))
        .json(
            &json!({"prompt": PROMPTS[1], "max_tokens": 1000, "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    let _ = stream.next().await.unwrap().unwrap();
    let _ = stream.next().await.unwrap().unwrap();
    let busy = s.metric("tandem:kv_cache_free_blocks", &[]).await.unwrap();
    assert!(busy < total, "the request holds blocks while running");
    drop(stream);
    common::wait_all_free(&[&s]).await;
    let aborted = s
        .metric(
            "tandem:request_success_total",
            &[("finished_reason", "abort")],
        )
        .await;
    assert_eq!(aborted, Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_logprobs_and_seeded_sampling() {
    let s = Server::serve(&[]);
    // ignore_eos: a sampled end-of-text would cut a choice short, and which token a seed draws
    // depends on the CPU's kernels (the lengths below are the point, not where EOS falls).
    let body = json!({"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0.8, "seed": 42, "n": 3,
                      "logprobs": 2, "ignore_eos": true});
    let (st, a) = post(&s, "/v1/completions", body.clone()).await;
    assert_eq!(st, 200, "{a}");
    let (_, b) = post(&s, "/v1/completions", body).await;
    assert_eq!(a["choices"].as_array().unwrap().len(), 3);
    for i in 0..3 {
        assert_eq!(
            a["choices"][i]["text"], b["choices"][i]["text"],
            "seeded sampling is reproducible"
        );
        let lp = &a["choices"][i]["logprobs"];
        assert_eq!(lp["tokens"].as_array().unwrap().len(), 8);
        assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
        assert!(lp["token_logprobs"][0].as_f64().unwrap() <= 0.0);
    }
    assert_eq!(a["usage"]["completion_tokens"], 24);
    // a negative seed is a seed too (vLLM accepts any 64-bit integer)
    let neg = json!({"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0.8, "seed": -7});
    let (st, x) = post(&s, "/v1/completions", neg.clone()).await;
    assert_eq!(st, 200, "{x}");
    let (_, y) = post(&s, "/v1/completions", neg).await;
    assert_eq!(x["choices"][0]["text"], y["choices"][0]["text"]);
}

/// OpenAI's and vLLM's sampling controls change the output as they say: `logit_bias` forces or
/// bans a token, `min_p: 1` leaves only the most likely token (so seeded sampling equals greedy),
/// the penalties stop the greedy loop of a repetitive prompt; bad values get a 400 naming them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_penalties_and_min_p_change_the_output() {
    let s = Server::serve(&[]);
    let ids = |body: &Value| -> Vec<u64> {
        body["choices"][0]["token_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("{body}"))
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    let gen = |extra: Value| {
        let mut b = json!({"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                           "return_token_ids": true});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let s = &s;
        async move {
            let (st, body) = post(s, "/v1/completions", b).await;
            assert_eq!(st, 200, "{body}");
            ids(&body)
        }
    };
    let greedy = gen(json!({})).await;
    // a +100 bias forces a token; a -100 bias bans the greedy first token
    let forced = gen(json!({"logit_bias": {"504": 100}})).await;
    assert!(forced.iter().all(|&t| t == 504), "{forced:?}");
    let banned = gen(json!({"logit_bias": {greedy[0].to_string(): -100}})).await;
    assert_ne!(banned[0], greedy[0]);
    assert!(!banned.contains(&greedy[0]), "{banned:?}");
    // min_p 1 keeps only the most likely token: a hot seeded sample is the greedy answer
    let hot = json!({"temperature": 1.5, "seed": 3});
    let mut min_p = hot.clone();
    min_p["min_p"] = json!(1.0);
    assert_eq!(gen(min_p).await, greedy);
    assert_ne!(
        gen(hot).await,
        greedy,
        "without min_p, a hot sample wanders"
    );
    // penalties: a prompt that invites repetition
    let loop_prompt = "one one one one one one one one one one one one";
    let rep = |extra: Value| {
        let mut b = extra;
        b["prompt"] = json!(loop_prompt);
        b["max_tokens"] = json!(16);
        gen(b)
    };
    let plain = rep(json!({})).await;
    let distinct = |v: &[u64]| v.iter().collect::<std::collections::HashSet<_>>().len();
    for penalty in [
        json!({"repetition_penalty": 1.5}),
        json!({"frequency_penalty": 2.0}),
        json!({"presence_penalty": 2.0}),
    ] {
        let out = rep(penalty.clone()).await;
        assert!(
            distinct(&out) > distinct(&plain),
            "{penalty}: {out:?} is no more varied than {plain:?}"
        );
    }
    // chat takes them too
    let (st, body) = post(
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
               "temperature": 0, "logit_bias": {"504": 100}, "return_token_ids": true}),
    )
    .await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(ids(&body), vec![504; 4]);
    for (field, value) in [
        ("logit_bias", json!({"not-a-token": 1})),
        ("logit_bias", json!({"99999999": 1})),
        ("logit_bias", json!({"5": 500})),
        ("presence_penalty", json!(3)),
        ("frequency_penalty", json!(-2.5)),
        ("repetition_penalty", json!(0)),
        ("min_p", json!(1.5)),
    ] {
        let (st, body) = post(
            &s,
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 2, field: value}),
        )
        .await;
        assert_eq!(st, 400, "{field}={value}: {body}");
        assert_eq!(body["error"]["param"], json!(field), "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_guards_the_api_but_not_the_probes() {
    let s = Server::serve(&["--api-key", "sk-tandem-test"]);
    let c = client();
    let body = json!({"prompt": "Hi", "max_tokens": 2});
    for key in [None, Some("wrong"), Some("sk-tandem-tes")] {
        let mut r = c.post(s.url("/v1/completions")).json(&body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        let r = r.send().await.unwrap();
        assert_eq!(r.status(), 401, "{key:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
    }
    let r = c.get(s.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .post(s.url("/v1/completions"))
        .bearer_auth("sk-tandem-test")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for open in ["/health", "/metrics"] {
        let r = c.get(s.url(open)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{open}");
    }
}

/// Idle sockets beyond the connection limit, the first ones holding every slot with a body that
/// never ends, others with half a request line: they are closed (over the limit at once, the rest
/// at the header or body timeout) and `/health` keeps answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_over_the_limit_do_not_stop_health() {
    use std::io::Write;
    let s = Server::serve(&["--max-connections", "16", "--header-read-timeout-secs", "1"]);
    let addr = format!("127.0.0.1:{}", s.port);
    let mut idle = Vec::new();
    for i in 0..300 {
        let Ok(mut sock) = std::net::TcpStream::connect(&addr) else {
            continue;
        };
        if i < 16 {
            // The first ones take every connection slot and trickle a body that never ends.
            let _ = sock.write_all(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                  Content-Length: 1000\r\n\r\n{\"prompt\": \"",
            );
        } else if i % 2 == 0 {
            let _ = sock.write_all(b"POST /v1/completions HTT");
        }
        idle.push(sock);
    }
    let started = std::time::Instant::now();
    let answered = loop {
        if common::http_get_status(&s.url("/health")) == Some(200) {
            break true;
        }
        if started.elapsed() > Duration::from_secs(5) {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        answered,
        "/health did not answer with {} idle sockets",
        idle.len()
    );
    // The server accepts (and turns away) the sockets over the limit as its accept loop reaches
    // them: on a loaded machine that can be after /health first answers.
    let mut rejected = 0.0;
    for _ in 0..100 {
        rejected = s
            .metric("tandem:http_connections_rejected_total", &[])
            .await
            .unwrap_or(0.0);
        if rejected > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        rejected > 0.0,
        "no connection over the limit was turned away"
    );
    drop(idle);
}

/// Logs to a file carry no ANSI colour codes; `--log-format json` (here through its environment
/// variable) writes one JSON object per line with the level and the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_plain_off_a_terminal_and_json_on_request() {
    let text = Server::serve(&[]);
    let (st, _) = post(
        &text,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 1}),
    )
    .await;
    assert_eq!(st, 200);
    let log = text.log_text();
    assert!(log.contains("INFO"), "{log}");
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in a log file: {log:?}"
    );
    drop(text);

    common::require_model();
    let json_log = Server::start("serve", &[], &[("TANDEM_LOG_FORMAT", "json")]);
    let log = json_log.log_text();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    for line in &lines {
        let v: Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v["level"].is_string() && v["message"].is_string(), "{line}");
        assert!(v["timestamp"].is_string(), "{line}");
    }
    assert!(lines.iter().any(|l| l.contains("\"INFO\"")), "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_labelled_by_model_and_counters_start_at_zero() {
    let s = Server::serve(&["--served-model-name", "my-model"]);
    let text = client()
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // Before any request: every counter with known labels is there, at 0, labelled.
    for (name, labels) in [
        ("tandem:prompt_tokens_total", vec![]),
        ("tandem:kv_transfer_failures_total", vec![]),
        ("tandem:nixl_num_failed_transfers", vec![]),
        (
            "tandem:request_success_total",
            vec![("finished_reason", "abort")],
        ),
        (
            "tandem:kv_load_failures_total",
            vec![("policy", "recompute")],
        ),
        (
            "tandem:kv_transfer_refused_total",
            vec![("reason", "lease")],
        ),
        (
            "tandem:kv_checksum_loads_total",
            vec![("verdict", "mismatch")],
        ),
        (
            "tandem:kv_checksum_unverified_total",
            vec![("reason", "unaligned_first_block")],
        ),
    ] {
        let mut l = labels.clone();
        l.push(("model_name", "my-model"));
        assert_eq!(
            common::parse_metric(&text, name, &l),
            Some(0.0),
            "{name} {labels:?}"
        );
    }
    let info = text
        .lines()
        .find(|l| l.starts_with("tandem:cache_config_info{"))
        .expect("cache_config_info");
    assert!(
        info.contains(r#"block_size="16""#) && info.ends_with(" 1"),
        "{info}"
    );
    // One request: vLLM's per-request histograms observe it once.
    let (st, v) = post(
        &s,
        "/v1/completions",
        json!({"prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let m = |name: &'static str| {
        let s = &s;
        async move { s.metric(name, &[("model_name", "my-model")]).await }
    };
    for name in [
        "tandem:request_queue_time_seconds_count",
        "tandem:request_prefill_time_seconds_count",
        "tandem:request_decode_time_seconds_count",
        "tandem:request_inference_time_seconds_count",
        "tandem:request_prompt_tokens_count",
        "tandem:request_generation_tokens_count",
    ] {
        assert_eq!(m(name).await, Some(1.0), "{name}");
    }
    assert_eq!(m("tandem:request_generation_tokens_sum").await, Some(5.0));
    let prompt = v["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(m("tandem:request_prompt_tokens_sum").await, Some(prompt));
    // Tokens per step add up to every token computed: the prompt and all but the last output.
    assert_eq!(
        m("tandem:iteration_tokens_total_sum").await,
        Some(prompt + 4.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_prompts_answers_each_prompt_n_times_in_vllm_order() {
    let s = Server::serve(&[]);
    let prompts = &PROMPTS[..3];
    let mut want = Vec::new();
    for p in prompts {
        want.push(complete_ids(&s, p, 6).await);
    }
    let (st, v) = post(
        &s,
        "/v1/completions",
        json!({"prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0,
            "return_token_ids": true, "echo": true}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], json!(i));
        let ids: Vec<u64> = c["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(ids, want[i / 2], "choice {i} answers prompt {}", i / 2);
        let text = c["text"].as_str().unwrap();
        assert!(
            text.starts_with(prompts[i / 2]),
            "echo of its own prompt: {text}"
        );
        assert!(c["prompt_token_ids"]
            .as_array()
            .is_some_and(|p| !p.is_empty()));
    }
    let prompt_tokens: u64 = choices
        .iter()
        .step_by(2)
        .map(|c| c["prompt_token_ids"].as_array().unwrap().len() as u64)
        .sum();
    assert_eq!(v["usage"]["prompt_tokens"], json!(prompt_tokens));
    let completion: usize = want.iter().map(|w| 2 * w.len()).sum();
    assert_eq!(v["usage"]["completion_tokens"], json!(completion));

    // Streamed: the same tokens, per index.
    let r = client()
        .post(s.url("/v1/completions"))
        .json(
            &json!({"prompt": prompts, "max_tokens": 6, "temperature": 0,
            "stream": true, "return_token_ids": true,
            "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap();
    let mut got = vec![Vec::new(); 3];
    let mut usage = Value::Null;
    for ev in common::sse_events(r).await {
        let Ok(c) = serde_json::from_str::<Value>(&ev) else {
            continue;
        };
        if !c["usage"].is_null() {
            usage = c["usage"].clone();
        }
        for ch in c["choices"].as_array().into_iter().flatten() {
            let i = ch["index"].as_u64().unwrap() as usize;
            got[i].extend(
                ch["token_ids"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|x| x.as_u64().unwrap()),
            );
        }
    }
    assert_eq!(got, want);
    assert_eq!(usage["prompt_tokens"], json!(prompt_tokens));

    // Token lists too; an empty list, too many sequences and a P/D batch are refused by name.
    let toks: Vec<Vec<u32>> = vec![vec![504, 3458], vec![1, 2, 3]];
    let (st, v) = post(
        &s,
        "/v1/completions",
        json!({"prompt": toks, "max_tokens": 2, "temperature": 0}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    for body in [
        json!({"prompt": [], "max_tokens": 2}),
        json!({"prompt": vec!["a"; 20], "n": 8, "max_tokens": 2}),
        json!({"prompt": ["a", "b"], "max_tokens": 2,
            "kv_transfer_params": {"do_remote_decode": true}}),
    ] {
        let (st, v) = post(&s, "/v1/completions", body.clone()).await;
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], json!("prompt"), "{v}");
    }
    common::wait_all_free(&[&s]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn best_of_returns_the_sequences_with_the_highest_cumulative_logprob() {
    // No prefix cache: both runs compute the prompt the same way.
    let s = Server::serve(&["--enable-prefix-caching", "false"]);
    let base = json!({"prompt": "My favourite animal is", "max_tokens": 5, "temperature": 1.0,
        "seed": 42, "ignore_eos": true, "logprobs": 0});
    let sum = |c: &Value| -> f64 {
        c["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .sum()
    };
    // The four sequences best_of=4 draws (seeds 42..45, as n=4 draws them).
    let mut all = base.clone();
    all["n"] = json!(4);
    let (st, v) = post(&s, "/v1/completions", all).await;
    assert_eq!(st, 200, "{v}");
    let mut scores: Vec<(f64, String)> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (sum(c), c["text"].as_str().unwrap().to_string()))
        .collect();
    scores.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut best = base.clone();
    best["best_of"] = json!(4);
    best["n"] = json!(2);
    let (st, v) = post(&s, "/v1/completions", best).await;
    assert_eq!(st, 200, "{v}");
    let got: Vec<String> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        got,
        vec![scores[0].1.clone(), scores[1].1.clone()],
        "{scores:?}"
    );
    assert_eq!(v["choices"][1]["index"], json!(1));
    assert_eq!(
        v["usage"]["completion_tokens"],
        json!(20),
        "all 4 were generated"
    );
    // Without logprobs asked, none are returned (they were only used to rank).
    let (st, v) = post(
        &s,
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 3, "best_of": 3, "seed": 1}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "Hi", "n": 3, "best_of": 2}),
        ),
        ("/v1/completions", json!({"prompt": "Hi", "best_of": 17})),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "best_of": 2, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "best_of": 2}),
        ),
    ] {
        let (st, v) = post(&s, path, body.clone()).await;
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], json!("best_of"), "{v}");
    }
    common::wait_all_free(&[&s]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exported_tokenizer_encodes_as_the_server_does() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["export-tokenizer", "--model", "smollm2-135m"])
        .arg(dir.path())
        .current_dir(common::repo_root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = String::from_utf8_lossy(&out.stdout);
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        assert!(listed.contains(f), "{listed}");
    }
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert!(config["chat_template"]
        .as_str()
        .is_some_and(|t| t.contains("im_start")));
    assert_eq!(config["eos_token"], json!("<|im_end|>"));
    assert!(config["model_max_length"].as_u64().unwrap() >= 2048);
    // The file loads in Hugging Face's tokenizers and gives the server's ids, specials included.
    let hf = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    let s = Server::serve(&[]);
    for text in [
        "The capital of France is",
        "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
        "  spaces, 12345 digits, émoji 🚀 and <|im_start|>user\nhi<|im_end|>",
    ] {
        let (st, v) = post(&s, "/tokenize", json!({"prompt": text})).await;
        assert_eq!(st, 200, "{v}");
        let want: Vec<u32> = v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let got = hf.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "{text:?}");
        let plain = hf.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(
            hf.decode(&plain, false).unwrap(),
            text.to_string(),
            "round trip"
        );
    }
}

/// vLLM's `prompt_logprobs` entry of token `id` at one prompt position: (logprob, rank).
fn prompt_entry(position: &Value, id: u64) -> (f64, u64) {
    let e = &position[id.to_string()];
    (e["logprob"].as_f64().unwrap(), e["rank"].as_u64().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_and_echo_equal_the_logprobs_of_each_prefix() {
    let s = Server::serve(&[]);
    let (st, tok) = post(
        &s,
        "/tokenize",
        json!({"prompt": "The capital of France is Paris. The capital of Italy is"}),
    )
    .await;
    assert_eq!(st, 200, "{tok}");
    let ids: Vec<u64> = tok["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let body = json!({"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3,
                      "logprobs": 2, "echo": true, "return_token_ids": true});
    let (st, full) = post(&s, "/v1/completions", body.clone()).await;
    assert_eq!(st, 200, "{full}");
    let choice = &full["choices"][0];
    let plp = choice["prompt_logprobs"].as_array().unwrap();
    assert_eq!(plp.len(), ids.len());
    assert!(plp[0].is_null(), "nothing predicts the first token");
    // Each position holds the prompt token's logprob and rank: the rank-1 token and its logprob
    // are what greedy decoding of the prefix before it returns.
    for i in 1..ids.len() {
        let entries = plp[i].as_object().unwrap();
        assert!((3..=4).contains(&entries.len()), "{i}: {entries:?}");
        let (own, own_rank) = prompt_entry(&plp[i], ids[i]);
        let (st, next) = post(
            &s,
            "/v1/completions",
            json!({"prompt": &ids[..i], "max_tokens": 1, "temperature": 0, "logprobs": 1,
                   "return_token_ids": true}),
        )
        .await;
        assert_eq!(st, 200, "{next}");
        let best = next["choices"][0]["token_ids"][0].as_u64().unwrap();
        let best_lp = next["choices"][0]["logprobs"]["token_logprobs"][0]
            .as_f64()
            .unwrap();
        let (lp, rank) = prompt_entry(&plp[i], best);
        assert_eq!(rank, 1, "position {i}: {entries:?}, greedy {best}");
        assert!(
            (lp - best_lp).abs() < 1e-2,
            "position {i}: {lp} vs {best_lp}"
        );
        assert_eq!(own_rank == 1, ids[i] == best, "position {i}");
        assert!(own <= lp + 1e-6);
        // echo + logprobs: the prompt's tokens come first, with the same logprobs
        let echoed = &choice["logprobs"]["token_logprobs"][i];
        assert!(
            (echoed.as_f64().unwrap() - own).abs() < 1e-6,
            "{echoed} vs {own}"
        );
    }
    let echoed = &choice["logprobs"];
    assert!(echoed["token_logprobs"][0].is_null() && echoed["top_logprobs"][0].is_null());
    assert_eq!(
        echoed["tokens"].as_array().unwrap().len(),
        ids.len() + 2,
        "{echoed}"
    );
    // Again (a prefix-cache hit is not taken) and streamed: the same values.
    let (_, again) = post(&s, "/v1/completions", body.clone()).await;
    assert_eq!(
        again["choices"][0]["prompt_logprobs"],
        choice["prompt_logprobs"]
    );
    let events = stream_json(&s, "/v1/completions", &body).await;
    let with_prompt: Vec<&Value> = events
        .iter()
        .filter(|e| !e["choices"][0]["prompt_logprobs"].is_null())
        .collect();
    assert_eq!(with_prompt.len(), 1, "{events:?}");
    assert_eq!(
        with_prompt[0]["choices"][0]["prompt_logprobs"],
        choice["prompt_logprobs"]
    );
    // A prompt longer than one step's prompt-logprob rows: every position answered.
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(40);
    let (st, b) = post(
        &s,
        "/v1/completions",
        json!({"prompt": long, "max_tokens": 1, "prompt_logprobs": 0}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    let plp = b["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(
        plp.len() as u64,
        b["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert!(plp.len() > 300 && plp[1..].iter().all(|p| p.as_object().unwrap().len() == 1));
    // Chat answers them once, at the top level.
    let (st, c) = post(
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
               "prompt_logprobs": 1}),
    )
    .await;
    assert_eq!(st, 200, "{c}");
    assert_eq!(
        c["prompt_logprobs"].as_array().unwrap().len() as u64,
        c["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    // Where the prompt is not computed (P/D), refused by name; bounds as for logprobs.
    for (extra, param) in [
        (
            json!({"prompt_logprobs": 1, "kv_transfer_params": {"do_remote_decode": true}}),
            "prompt_logprobs",
        ),
        (
            json!({"echo": true, "logprobs": 1, "kv_transfer_params": {"do_remote_decode": true}}),
            "echo",
        ),
        (json!({"prompt_logprobs": 21}), "prompt_logprobs"),
    ] {
        let mut b = json!({"prompt": "hi", "max_tokens": 1});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (st, e) = post(&s, "/v1/completions", b).await;
        assert_eq!(st, 400, "{e}");
        assert_eq!(e["error"]["param"], json!(param), "{e}");
    }
    common::wait_all_free(&[&s]).await;
}

/// The answer's object under a schema that bounds every field, so a complete object fits.
fn bounded_schema() -> Value {
    json!({"type": "object",
           "properties": {"answer": {"type": "string", "maxLength": 24},
                          "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
           "required": ["answer", "confidence"], "additionalProperties": false})
}

fn check_bounded(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 2, "{text}");
    assert!(
        v["answer"].as_str().unwrap().chars().count() <= 24,
        "{text}"
    );
    assert!(
        (0..=100).contains(&v["confidence"].as_i64().unwrap()),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_and_forced_tool_calls_follow_their_grammar() {
    let s = Server::serve(&[]);
    let questions = [
        "What is the capital of France?",
        "Name a primary color.",
        "How many legs does a spider have?",
        "Who wrote Hamlet?",
    ];
    let chat = |q: &str, extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": q}], "max_tokens": 60,
                           "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    // Every form, concurrently over several prompts (the masks batch).
    let forms = [
        json!({"response_format": {"type": "json_schema",
               "json_schema": {"name": "a", "schema": bounded_schema()}}}),
        json!({"guided_json": bounded_schema(), "temperature": 1.0, "seed": 3}),
        json!({"structured_outputs": {"json": bounded_schema()}}),
        json!({"guided_choice": ["yes", "no", "maybe"]}),
        json!({"guided_regex": "[0-9]{3}-[0-9]{4}"}),
    ];
    let mut calls = Vec::new();
    for q in questions {
        for f in &forms {
            let body = chat(q, f.clone());
            let s = &s;
            calls.push(async move { (body.clone(), post(s, "/v1/chat/completions", body).await) });
        }
    }
    for (sent, (st, body)) in futures::future::join_all(calls).await {
        assert_eq!(st, 200, "{sent}: {body}");
        let c = &body["choices"][0];
        assert_eq!(c["finish_reason"], "stop", "{sent}: {body}");
        let text = c["message"]["content"].as_str().unwrap();
        if sent.get("guided_choice").is_some() {
            assert!(["yes", "no", "maybe"].contains(&text), "{text:?}");
        } else if sent.get("guided_regex").is_some() {
            let b = text.as_bytes();
            assert!(
                b.len() == 8
                    && b[3] == b'-'
                    && text.replace('-', "").bytes().all(|c| c.is_ascii_digit()),
                "{text:?}"
            );
        } else {
            check_bounded(text);
        }
    }
    // json_object, and n sampled choices on /v1/completions, each under the grammar.
    let (st, b) = post(
        &s,
        "/v1/completions",
        json!({"prompt": "A JSON object describing a cat:", "max_tokens": 60, "n": 3,
               "temperature": 1.0, "seed": 5, "guided_json": bounded_schema()}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    for c in b["choices"].as_array().unwrap() {
        check_bounded(c["text"].as_str().unwrap());
    }
    let (st, b) = post(
        &s,
        "/v1/chat/completions",
        chat(
            "Describe Paris as JSON.",
            json!({"response_format": {"type": "json_object"}, "max_tokens": 200}),
        ),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    let c = &b["choices"][0];
    let text = c["message"]["content"].as_str().unwrap();
    if c["finish_reason"] == "stop" {
        assert!(
            serde_json::from_str::<Value>(text).unwrap().is_object(),
            "{text}"
        );
    } else {
        assert!(text.trim_start().starts_with('{'), "{text}");
    }
    // Tools: a named function gets its arguments; required gets one or more offered calls.
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
            "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"], "additionalProperties": false}}}]);
    let named = chat(
        "What is the weather in Paris?",
        json!({"tools": tools,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    );
    let (st, b) = post(&s, "/v1/chat/completions", named.clone()).await;
    assert_eq!(st, 200, "{b}");
    let c = &b["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{b}");
    assert!(c["message"]["content"].is_null(), "{b}");
    let call = &c["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string(), "{args}");
    // streamed: the same call, whole, in the last chunk
    let events = stream_json(&s, "/v1/chat/completions", &named).await;
    let last = events
        .iter()
        .rfind(|e| !e["choices"][0]["finish_reason"].is_null())
        .unwrap();
    assert_eq!(
        last["choices"][0]["finish_reason"], "tool_calls",
        "{events:?}"
    );
    let streamed_call = &last["choices"][0]["delta"]["tool_calls"][0];
    assert_eq!(streamed_call["function"], call["function"]);
    assert_eq!(streamed_call["index"], 0);
    let (st, b) = post(
        &s,
        "/v1/chat/completions",
        chat(
            "What time is it in Berlin?",
            json!({"tools": tools, "tool_choice": "required"}),
        ),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    let calls = b["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert!(!calls.is_empty(), "{b}");
    for call in calls {
        let name = call["function"]["name"].as_str().unwrap();
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        match name {
            "get_weather" => assert!(args["city"].is_string(), "{args}"),
            "get_time" => assert!(["UTC", "CET"].contains(&args["zone"].as_str().unwrap())),
            other => panic!("{other}"),
        }
    }
    // auto: plain content (no tool-call format in this model's template)
    let (st, b) = post(
        &s,
        "/v1/chat/completions",
        chat(
            "Hi",
            json!({"tools": tools, "tool_choice": "auto", "max_tokens": 4}),
        ),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    assert!(b["choices"][0]["message"]["content"].is_string(), "{b}");
    // What cannot be honoured is refused by name.
    for (extra, param) in [
        (
            json!({"guided_choice": ["a"], "ignore_eos": true}),
            "ignore_eos",
        ),
        (
            json!({"guided_choice": ["a"], "min_tokens": 2}),
            "min_tokens",
        ),
        (
            json!({"guided_choice": ["a"], "guided_regex": "a"}),
            "guided_choice",
        ),
        (
            json!({"guided_choice": ["a"], "tools": tools, "tool_choice": "required"}),
            "tool_choice",
        ),
        (json!({"guided_regex": "(unclosed"}), "guided_regex"),
    ] {
        let (st, e) = post(&s, "/v1/chat/completions", chat("Hi", extra.clone())).await;
        assert_eq!(st, 400, "{extra}: {e}");
        assert_eq!(e["error"]["param"], json!(param), "{e}");
    }
    common::wait_all_free(&[&s]).await;
}

/// Without `--max-num-batched-tokens` a long prompt is prefilled in chunks of the default
/// 512-token step budget; without chunked prefill the budget is the whole context, so the same
/// prompt is one step (the server starts: no budget below the max model length is refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_step_budget_chunks_a_long_prompt_and_without_chunking_takes_it_whole() {
    let prompt: Vec<u32> = (0..1200).map(|i| 1000 + (i * 7919 % 20_000)).collect();
    let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
    // Steps of more than `le` tokens, and steps in all.
    async fn steps(s: &Server, le: &str) -> (f64, f64) {
        let count = s
            .metric("tandem:iteration_tokens_total_count", &[])
            .await
            .expect("the step histogram");
        let within = s
            .metric("tandem:iteration_tokens_total_bucket", &[("le", le)])
            .await
            .expect("the bucket");
        (count - within, count)
    }

    let chunked = Server::serve(&[]);
    let (st, out) = post(&chunked, "/v1/completions", body.clone()).await;
    assert_eq!(st, 200, "{out}");
    let (over_512, all) = steps(&chunked, "512").await;
    assert_eq!(over_512, 0.0, "a step over the default budget of 512");
    assert!(
        all >= 3.0,
        "1200 prompt tokens in {all} steps of at most 512"
    );

    let whole = Server::serve(&["--enable-chunked-prefill", "false"]);
    let (st, out) = post(&whole, "/v1/completions", body).await;
    assert_eq!(st, 200, "{out}");
    let (over_1024, _) = steps(&whole, "1024").await;
    assert_eq!(over_1024, 1.0, "the prompt in one step of 1200 tokens");
}

/// A CPU build asked for a GPU, and bad device names, stop at start-up with an error that names
/// the flag, before any port is bound.
#[test]
fn device_flags_a_cpu_build_cannot_serve_are_refused_at_start() {
    common::require_model();
    for (device, want) in [
        ("cuda", "needs a tandem built with the `cuda` feature"),
        ("cuda:1", "needs a tandem built with the `cuda` feature"),
        ("gpu", "--device `gpu`: expected cpu, cuda or cuda:N"),
        ("cuda:x", "--device `cuda:x`"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["serve", "--device", device, "--port", "0"])
            .current_dir(common::repo_root())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{device}: {stderr}");
        assert!(stderr.contains(want), "{device}: {stderr}");
    }
}
