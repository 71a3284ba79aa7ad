//! Metrics end to end through a real Prometheus: a producer, a clean consumer, a consumer whose
//! loads are corrupted on purpose, and a proxy in front of each consumer, all scraped by the
//! Prometheus server that `scripts/setup.sh` unpacks into `.tools/prometheus`. The counts that
//! Prometheus stores must be the ones the requests produced, per instance and per label, and
//! equal to what each instance's own `/metrics` says.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, http_get_status, repo_root, Server};
use serde_json::{json, Value};

/// A Prometheus server scraping fixed targets every second, killed on drop.
struct Prometheus {
    child: Child,
    base: String,
    dir: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn prometheus_binary() -> PathBuf {
    let path = std::env::var_os("TANDEM_PROMETHEUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".tools/prometheus/usr/bin/prometheus"));
    assert!(
        path.exists(),
        "Prometheus is missing at {}: run scripts/setup.sh first",
        path.display()
    );
    path
}

impl Prometheus {
    /// Starts Prometheus with one job per `(job, "host:port")` target.
    fn start(jobs: &[(&str, String)]) -> Prometheus {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("tandem-test-prometheus-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut config = String::from("global:\n  scrape_interval: 1s\nscrape_configs:\n");
        for (job, target) in jobs {
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [\"{target}\"]\n"
            ));
        }
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new(prometheus_binary())
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start prometheus");
        let mut p = Prometheus {
            child,
            base: format!("http://127.0.0.1:{port}"),
            dir,
        };
        let start = Instant::now();
        while http_get_status(&format!("{}/-/ready", p.base)) != Some(200) {
            if let Ok(Some(status)) = p.child.try_wait() {
                panic!("prometheus exited with {status}:\n{}", p.log_text());
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "prometheus did not become ready:\n{}",
                p.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        p
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// The value of an instant query that yields one series (None when it yields none).
    async fn value(&self, query: &str) -> Option<f64> {
        common::prometheus_query(&self.base, query).await
    }

    /// Waits until `query` equals `want` (the scrape after the last request may lag a second).
    async fn wait_for(&self, query: &str, want: f64) {
        let start = Instant::now();
        loop {
            let got = self.value(query).await;
            if got == Some(want) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{query}: {got:?}, want {want}\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

fn target(s: &Server) -> String {
    format!("127.0.0.1:{}", s.port)
}

async fn complete(base: &str, prompt: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .timeout(Duration::from_secs(300))
        .json(&json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_what_requests_did() {
    let producer =
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer","enable_kv_checksum":true}"#;
    let consumer = r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","enable_kv_checksum":true,"kv_checksum_fail_closed":true,"kv_load_failure_policy":"recompute"}"#;
    let faulty = r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","enable_kv_checksum":true,"kv_checksum_fail_closed":true,"kv_load_failure_policy":"recompute","kv_fault_injection":{"kind":"corrupt_byte","probability":1.0,"seed":3}}"#;
    let prefill = Server::serve(&["--kv-transfer-config", producer]);
    let decode = Server::serve(&["--kv-transfer-config", consumer]);
    let decode_faulty = Server::serve(&["--kv-transfer-config", faulty]);
    let proxy = |d: &Server| {
        Server::start(
            "proxy",
            &["--prefill", &prefill.base, "--decode", &d.base],
            &[],
        )
    };
    let proxy_clean = proxy(&decode);
    let proxy_faulty = proxy(&decode_faulty);
    let prom = Prometheus::start(&[
        ("prefill", target(&prefill)),
        ("decode", target(&decode)),
        ("decode_faulty", target(&decode_faulty)),
        ("proxy_clean", target(&proxy_clean)),
        ("proxy_faulty", target(&proxy_faulty)),
    ]);

    let prompts = [
        "The capital of France is",
        "Once upon a time, in a small village,",
        "def fibonacci(n):",
        "The river flows through the old town, past the market and",
    ];
    let (clean, corrupted) = (prompts.len(), 3);
    let mut answers = Vec::new();
    for p in prompts {
        let (st, v) = complete(&proxy_clean.base, p).await;
        assert_eq!(st, 200, "{v}");
        answers.push(v["choices"][0]["text"].clone());
    }
    for (p, want) in prompts.iter().zip(&answers).take(corrupted) {
        // fail-closed + recompute: every load is caught, the answer is still right
        let (st, v) = complete(&proxy_faulty.base, p).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(&v["choices"][0]["text"], want, "{p}");
    }

    for job in [
        "prefill",
        "decode",
        "decode_faulty",
        "proxy_clean",
        "proxy_faulty",
    ] {
        prom.wait_for(&format!("up{{job=\"{job}\"}}"), 1.0).await;
    }
    let loads = |job: &str, verdict: &str| {
        format!("tandem:kv_checksum_loads_total{{job=\"{job}\",verdict=\"{verdict}\"}}")
    };
    prom.wait_for(&loads("decode", "verified"), clean as f64)
        .await;
    prom.wait_for(&loads("decode_faulty", "mismatch"), corrupted as f64)
        .await;
    prom.wait_for(
        "tandem:kv_checksum_sends_total{job=\"prefill\"}",
        (clean + corrupted) as f64,
    )
    .await;
    // nothing else was counted under other verdicts
    prom.wait_for(
        "sum(tandem:kv_checksum_loads_total{job=\"decode\"})",
        clean as f64,
    )
    .await;
    prom.wait_for(
        "sum(tandem:kv_checksum_loads_total{job=\"decode_faulty\"})",
        corrupted as f64,
    )
    .await;
    prom.wait_for(
        "tandem:kv_load_failures_total{job=\"decode_faulty\",policy=\"recompute\"}",
        corrupted as f64,
    )
    .await;
    // each corrupted load damaged at least one block; the clean consumer saw none
    let bad_blocks = prom
        .value("tandem:kv_checksum_mismatched_blocks_total{job=\"decode_faulty\"}")
        .await
        .unwrap();
    assert!(bad_blocks >= corrupted as f64, "{bad_blocks}");
    assert!(matches!(
        prom.value("tandem:kv_checksum_mismatched_blocks_total{job=\"decode\"}")
            .await,
        None | Some(0.0)
    ));
    // histograms arrive whole: the consumer checksummed every load
    let computed = prom
        .value("tandem:kv_checksum_compute_seconds_count{job=\"decode\"}")
        .await
        .unwrap();
    assert!(computed >= clean as f64, "{computed}");
    prom.wait_for(
        "tandem:kv_transfer_seconds_count{job=\"decode\"}",
        clean as f64,
    )
    .await;
    // the proxy counted each request it routed
    prom.wait_for(
        "sum(tandem:proxy_requests_total{job=\"proxy_clean\"})",
        clean as f64,
    )
    .await;
    prom.wait_for(
        "sum(tandem:proxy_requests_total{job=\"proxy_faulty\"})",
        corrupted as f64,
    )
    .await;
    // what Prometheus stored is what the instance exposes
    let direct = decode_faulty
        .metric("tandem:kv_checksum_mismatched_blocks_total", &[])
        .await;
    assert_eq!(direct, Some(bad_blocks));
}
