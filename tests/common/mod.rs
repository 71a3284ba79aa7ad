//! Shared helpers of the end-to-end tests: start real `tandem` processes on free ports, wait until
//! they answer, read their metrics, and kill them when the test ends (even when it fails).

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The default model file; tests that need it fail with a clear message when it is missing.
pub fn default_model_path() -> PathBuf {
    repo_root().join(".models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

pub fn require_model() {
    assert!(
        default_model_path().exists(),
        "the default model is missing: run scripts/setup.sh first"
    );
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running `tandem` process, killed on drop.
pub struct Server {
    pub child: Child,
    pub port: u16,
    pub base: String,
    pub log: PathBuf,
}

impl Server {
    /// Sends `signal` to the process (SIGKILL, SIGSTOP, SIGCONT, SIGTERM).
    pub fn signal(&self, signal: i32) {
        // SAFETY: a signal to our own child process.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `tandem serve` with `args` (plus `--port`, `--host 127.0.0.1`) and waits for /health.
    pub fn serve(args: &[&str]) -> Server {
        require_model();
        Self::start("serve", args, &[])
    }

    pub fn start(sub: &str, args: &[&str], env: &[(&str, &str)]) -> Server {
        Self::start_at(None, "127.0.0.1", sub, args, env)
    }

    /// Starts `tandem <sub>` listening on `host`, inside network namespace `netns` if given.
    pub fn start_at(
        netns: Option<&str>,
        host: &str,
        sub: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Server {
        // A port found free can be taken before the server binds it (its own NIXL agent opens
        // ephemeral ports first): a start that lost that race is retried on another port.
        for _ in 0..3 {
            let port = free_port();
            let started =
                std::panic::catch_unwind(|| Self::start_on(netns, host, port, sub, args, env));
            match started {
                Ok(server) => return server,
                Err(e) => {
                    let log = std::env::temp_dir().join(format!("tandem-test-{sub}-{port}.log"));
                    let text = std::fs::read_to_string(log).unwrap_or_default();
                    if !text.contains("Address already in use") {
                        std::panic::resume_unwind(e);
                    }
                }
            }
        }
        panic!("tandem {sub}: three ports in a row were taken before it bound them")
    }

    /// [`Self::start_at`] on a given port (a restart where the last process listened).
    pub fn start_on(
        netns: Option<&str>,
        host: &str,
        port: u16,
        sub: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Server {
        let log = std::env::temp_dir().join(format!("tandem-test-{sub}-{port}.log"));
        let logf = std::fs::File::create(&log).unwrap();
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_tandem")]);
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_tandem")),
        };
        cmd.arg(sub)
            .args(args)
            .args(["--host", host, "--port", &port.to_string()])
            .current_dir(repo_root())
            .env("RUST_LOG", "info")
            .stdout(Stdio::from(logf.try_clone().unwrap()))
            .stderr(Stdio::from(logf));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("start tandem");
        let mut s = Server {
            child,
            port,
            base: format!("http://{host}:{port}"),
            log,
        };
        s.wait_healthy(Duration::from_secs(120));
        s
    }

    pub fn wait_healthy(&mut self, timeout: Duration) {
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("tandem exited with {status}:\n{}", self.log_text());
            }
            if http_get_status(&self.url("/health")) == Some(200) {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "tandem did not become healthy:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The value of one Prometheus series (first match of `name` with all `labels`), if present.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let text = reqwest::get(self.url("/metrics"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        parse_metric(&text, name, labels)
    }
}

impl Server {
    /// The sum of every series of `name` (0 when there is none).
    pub async fn metric_total(&self, name: &str) -> f64 {
        let Ok(r) = reqwest::get(self.url("/metrics")).await else {
            return 0.0;
        };
        let text = r.text().await.unwrap_or_default();
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (series, value) = l.rsplit_once(' ')?;
                let n = series.split('{').next()?;
                (n == name).then(|| value.parse::<f64>().ok())?
            })
            .sum()
    }
}

/// A 1P1D deployment behind the proxy (all three killed on drop).
pub struct Pd {
    pub prefill: Server,
    pub decode: Server,
    pub proxy: Server,
}

impl Pd {
    /// Starts `tandem serve PREFILL_ARGS`, `tandem serve DECODE_ARGS` and a proxy in front of
    /// them (with `proxy_args`).
    pub fn start(prefill_args: &[String], decode_args: &[String], proxy_args: &[&str]) -> Pd {
        fn strs(v: &[String]) -> Vec<&str> {
            v.iter().map(String::as_str).collect()
        }
        let prefill = Server::start("serve", &strs(prefill_args), &[]);
        let decode = Server::start("serve", &strs(decode_args), &[]);
        let mut args = vec!["--prefill", &prefill.base, "--decode", &decode.base];
        args.extend_from_slice(proxy_args);
        let proxy = Server::start("proxy", &args, &[]);
        Pd {
            prefill,
            decode,
            proxy,
        }
    }
}

/// `tandem serve` flags: `base`, then `extra`, then `--kv-transfer-config CONFIG`.
pub fn with_transfer_config(base: &[&str], extra: &[&str], config: &str) -> Vec<String> {
    base.iter()
        .chain(extra)
        .map(|s| s.to_string())
        .chain(["--kv-transfer-config".to_string(), config.to_string()])
        .collect()
}

/// The instance's count of KV loads with checksum verdict `v` (0 when absent).
pub async fn verdict(s: &Server, v: &str) -> f64 {
    s.metric("tandem:kv_checksum_loads_total", &[("verdict", v)])
        .await
        .unwrap_or(0.0)
}

/// Writes a dummy model's config (8 query heads, 2 KV heads, 4 layers) into `dir`; returns its
/// path. Its stem, `gqa-8x2`, is the served name.
pub fn dummy_gqa_config(dir: &std::path::Path) -> String {
    let path = dir.join("gqa-8x2.json");
    std::fs::write(
        &path,
        json!({"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
               "vocab_size": 512, "max_position_embeddings": 1024})
        .to_string(),
    )
    .unwrap();
    path.to_str().unwrap().to_owned()
}

/// Waits until every instance holds no block and runs no request.
pub async fn wait_all_free(servers: &[&Server]) {
    wait_all_free_within(servers, Duration::from_secs(30)).await
}

/// [`wait_all_free`] with a bound shorter than a producer's lease: blocks freed by an explicit
/// release, not by expiry.
pub async fn wait_all_free_within(servers: &[&Server], limit: Duration) {
    let start = Instant::now();
    for s in servers {
        loop {
            let free = s.metric("tandem:kv_cache_free_blocks", &[]).await.unwrap();
            let total = s.metric("tandem:kv_cache_total_blocks", &[]).await.unwrap();
            let running = s
                .metric("tandem:num_requests_running", &[])
                .await
                .unwrap_or(0.0);
            if free == total && running == 0.0 {
                break;
            }
            assert!(
                start.elapsed() < limit,
                "{}: {free}/{total} blocks free after {limit:?}",
                s.base
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Finds a sample line `name{labels} value` in Prometheus text.
pub fn parse_metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = match series.find('{') {
            Some(i) => (&series[..i], &series[i..]),
            None => (series, ""),
        };
        if n != name {
            return None;
        }
        if !labels
            .iter()
            .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
        {
            return None;
        }
        value.parse().ok()
    })
}

/// The status of `GET url` over a plain socket (health polling without an async runtime).
pub fn http_get_status(url: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut s = std::net::TcpStream::connect(host).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    String::from_utf8_lossy(&buf)
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
}

/// Reads an SSE body into its `data:` payloads.
pub async fn sse_events(resp: reqwest::Response) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = String::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
        buf.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        while let Some(i) = buf.find("\n\n") {
            let ev: String = buf.drain(..i + 2).collect();
            for line in ev.lines() {
                if let Some(d) = line.strip_prefix("data: ") {
                    out.push(d.to_string());
                }
            }
        }
    }
    out
}

/// Prefills `prompt` on a producer directly, as the proxy would (`max_tokens: 1`,
/// `do_remote_decode`), and returns the `kv_transfer_params` it answers.
pub async fn prefill_params(producer: &Server, prompt: &str) -> serde_json::Value {
    let r = reqwest::Client::new()
        .post(producer.url("/v1/completions"))
        .json(
            &serde_json::json!({"prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": true}}),
        )
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    let p = v["kv_transfer_params"].clone();
    assert_eq!(p["do_remote_prefill"], true, "{v}");
    p
}

/// The value of a Prometheus instant query at `base` (`http://host:port`) that yields at most one
/// series (None when it yields none).
pub async fn prometheus_query(base: &str, query: &str) -> Option<f64> {
    let v: serde_json::Value = reqwest::Client::new()
        .get(format!("{base}/api/v1/query"))
        .query(&[("query", query)])
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["status"], "success", "{query}: {v}");
    let result = v["data"]["result"].as_array().unwrap();
    assert!(result.len() <= 1, "{query} yields several series: {v}");
    result
        .first()
        .map(|s| s["value"][1].as_str().unwrap().parse().unwrap())
}

// --- OpenAI completions through reqwest (greedy ids, streamed text) ---

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

pub async fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

pub fn ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token ids in {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

pub async fn greedy_ids(base: &str, prompt: &str, max_tokens: usize) -> Vec<u64> {
    let (st, v) = post(
        base,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": true}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    ids(&v)
}

/// Streams a completion and returns its text and the token ids of its chunks.
pub async fn stream_text(base: &str, prompt: &str, max_tokens: usize) -> (String, Vec<u64>) {
    let r = client()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true, "return_token_ids": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = String::new();
    let mut s = r.bytes_stream();
    while let Some(c) = s.next().await {
        body.push_str(&String::from_utf8_lossy(&c.unwrap()));
    }
    let (mut text, mut toks) = (String::new(), Vec::new());
    for line in body.lines() {
        let Some(d) = line.strip_prefix("data: ") else {
            continue;
        };
        if d == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(d).unwrap();
        if let Some(c) = v["choices"].as_array().and_then(|c| c.first()) {
            text.push_str(c["text"].as_str().unwrap_or(""));
            toks.extend(
                c["token_ids"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|x| x.as_u64().unwrap()),
            );
        }
    }
    (text, toks)
}
