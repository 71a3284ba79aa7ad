//! The Docker Compose demo, run for real: images assembled without a registry by
//! `scripts/docker-images.sh` from the binary under test, `docker/docker-compose.yml` with
//! `docker-compose.local.yml`, real containers talking NIXL/UCX over TCP across the Compose
//! network, the real model, Prometheus in its container, the dashboard in headless Chromium.
//!
//! - `demo_serves_verified_answers_and_leaves_nothing`: up with `--scale decode=2`, healthy; the
//!   proxy finds both decode replicas; the reference prompts through the proxy equal a single
//!   instance's answers; every load verified, on both replicas, as the dashboard summary and
//!   Prometheus (in its container) count them; the dashboard renders in Chromium; containers run
//!   as uid 10001, unprivileged; `down` leaves no container, network or volume.
//! - `faults_across_containers`: a consumer that corrupts every load (fault injection) and holds
//!   each READ for a while after its claim: mismatches caught, recomputed to the reference
//!   answers, counted in Prometheus; the consumer cut off the network between its claim and its
//!   READ: the load fails by policy and no block is left on either side; the prefill container
//!   killed under load: every client ends within bounds, and after `compose start` the proxy
//!   serves again.
//!
//! One deployment at a time (`SERIAL`); every deployment has its own project name and is taken
//! down (`down -v`) by a guard, also when the test fails.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use common::{free_port, repo_root, Server};
use serde_json::{json, Value};

const TANDEM_IMAGE: &str = "tandem:cargo-test";
const PROMETHEUS_IMAGE: &str = "tandem-prometheus:cargo-test";
const SECRET: &str = "compose-test-deployment-secret";
const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The river flows through the old town, past the market and",
];
/// Longest any one request may take under the faults (prefill timeout + load timeout + decode).
const REQUEST_BOUND: Duration = Duration::from_secs(60);

/// One deployment at a time: the timing bounds assume the machine is theirs.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
/// The images are built once per test run, from the binary under test.
static IMAGES: StdMutex<Option<bool>> = StdMutex::new(None);
/// The single-instance answers to [`PROMPTS`].
static REFERENCE: tokio::sync::OnceCell<Vec<Vec<u64>>> = tokio::sync::OnceCell::const_new();

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    out
}

fn run_ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn docker(args: &[&str]) -> Command {
    let mut c = Command::new("docker");
    c.args(args);
    c
}

/// Builds the test images from the binary under test (once per run).
fn build_images() {
    let mut built = IMAGES.lock().unwrap_or_else(|e| e.into_inner());
    match *built {
        Some(true) => return,
        Some(false) => panic!("building the images failed earlier in this run"),
        None => {}
    }
    *built = Some(false);
    assert!(
        run(&mut docker(&["info", "--format", "{{.ServerVersion}}"]))
            .status
            .success(),
        "these tests need a running Docker engine"
    );
    let start = Instant::now();
    run_ok(
        Command::new(repo_root().join("scripts/docker-images.sh"))
            .arg(env!("CARGO_BIN_EXE_tandem"))
            .current_dir(repo_root())
            .env("TANDEM_IMAGE", TANDEM_IMAGE)
            .env("TANDEM_PROMETHEUS_IMAGE", PROMETHEUS_IMAGE),
    );
    eprintln!("images built in {:.1} s", start.elapsed().as_secs_f64());
    *built = Some(true);
}

/// The Compose command of this machine: the `docker compose` plugin, else `docker-compose`.
fn compose_program() -> Vec<&'static str> {
    let plugin = run(&mut docker(&["compose", "version"])).status.success();
    if plugin {
        vec!["docker", "compose"]
    } else {
        vec!["docker-compose"]
    }
}

/// A Compose project of the demo, taken down with its volumes when dropped.
struct Deployment {
    project: String,
    files: Vec<PathBuf>,
    proxy_port: u16,
    prometheus_port: u16,
    _dir: tempfile::TempDir,
}

impl Deployment {
    /// `up -d` of the demo under a fresh project name with `override_yaml` (if any) on top and
    /// `scale` replicas per service; waits until every container is healthy.
    fn up(name: &str, override_yaml: Option<&str>, scale: &[(&str, usize)]) -> Deployment {
        build_images();
        let dir = tempfile::tempdir().unwrap();
        let mut files = vec![
            repo_root().join("docker/docker-compose.yml"),
            repo_root().join("docker/docker-compose.local.yml"),
        ];
        if let Some(yaml) = override_yaml {
            let path = dir.path().join("override.yml");
            std::fs::write(&path, yaml).unwrap();
            files.push(path);
        }
        let d = Deployment {
            project: format!("tandemtest{name}{}", std::process::id()),
            files,
            proxy_port: free_port(),
            prometheus_port: free_port(),
            _dir: dir,
        };
        let start = Instant::now();
        let mut args = vec!["up".to_owned(), "-d".to_owned()];
        for (service, n) in scale {
            args.push("--scale".to_owned());
            args.push(format!("{service}={n}"));
        }
        let out = run(&mut d.compose(&args.iter().map(String::as_str).collect::<Vec<_>>()));
        assert!(
            out.status.success(),
            "compose up failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            d.logs()
        );
        d.wait_healthy(Duration::from_secs(240));
        eprintln!(
            "{}: up and healthy in {:.1} s",
            d.project,
            start.elapsed().as_secs_f64()
        );
        d
    }

    fn compose(&self, args: &[&str]) -> Command {
        let program = compose_program();
        let mut c = Command::new(program[0]);
        c.args(&program[1..]).args(["-p", &self.project]);
        for f in &self.files {
            c.arg("-f").arg(f);
        }
        c.args(args)
            .current_dir(repo_root())
            .env("TANDEM_IMAGE", TANDEM_IMAGE)
            .env("TANDEM_PROMETHEUS_IMAGE", PROMETHEUS_IMAGE)
            .env("TANDEM_PROXY_PORT", self.proxy_port.to_string())
            .env("TANDEM_PROMETHEUS_PORT", self.prometheus_port.to_string())
            .env("TANDEM_KV_TRANSFER_SECRET", SECRET);
        c
    }

    /// The project's containers (of one service, if given), running or not.
    fn containers(&self, service: Option<&str>) -> Vec<String> {
        let project = format!("label=com.docker.compose.project={}", self.project);
        let mut c = docker(&["ps", "-a", "-q", "--filter", &project]);
        if let Some(s) = service {
            c.args(["--filter", &format!("label=com.docker.compose.service={s}")]);
        }
        run_ok(&mut c)
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    }

    fn network(&self) -> String {
        let project = format!("label=com.docker.compose.project={}", self.project);
        let out = run_ok(&mut docker(&["network", "ls", "-q", "--filter", &project]));
        let ids: Vec<&str> = out.split_whitespace().collect();
        assert_eq!(ids.len(), 1, "{out}");
        ids[0].to_owned()
    }

    fn logs(&self) -> String {
        let out = run(&mut self.compose(&["logs", "--no-color", "--tail", "40"]));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until every container of the project runs and reports healthy.
    fn wait_healthy(&self, timeout: Duration) {
        let start = Instant::now();
        loop {
            let ids = self.containers(None);
            let mut args = vec![
                "inspect",
                "--format",
                "{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
            ];
            args.extend(ids.iter().map(String::as_str));
            let states = if ids.is_empty() {
                String::new()
            } else {
                run_ok(&mut docker(&args))
            };
            let ready = !ids.is_empty() && states.lines().all(|l| l.ends_with(" running healthy"));
            if ready {
                return;
            }
            assert!(
                !states
                    .lines()
                    .any(|l| l.contains(" exited") || l.contains(" dead")),
                "a container stopped:\n{states}\n{}",
                self.logs()
            );
            assert!(
                start.elapsed() < timeout,
                "not healthy after {timeout:?}:\n{states}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    fn proxy(&self) -> String {
        format!("http://127.0.0.1:{}", self.proxy_port)
    }

    /// The proxy's dashboard summary: instances, their health and metrics.
    async fn summary(&self) -> Value {
        client()
            .get(format!("{}/dashboard/summary", self.proxy()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Waits until the proxy has `want` healthy instances of `role` (and no others).
    async fn wait_instances(&self, role: &str, want: usize) {
        let start = Instant::now();
        loop {
            let health: Value = match client()
                .get(format!("{}/health", self.proxy()))
                .send()
                .await
            {
                Ok(r) => r.json().await.unwrap_or(Value::Null),
                Err(_) => Value::Null,
            };
            let list = health[role].as_array().cloned().unwrap_or_default();
            if list.len() == want && list.iter().all(|i| i["healthy"] == true) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the proxy does not see {want} healthy {role} instances: {health}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The value of a Prometheus instant query that yields at most one series.
    async fn prometheus(&self, query: &str) -> Option<f64> {
        let base = format!("http://127.0.0.1:{}", self.prometheus_port);
        common::prometheus_query(&base, query).await
    }

    /// Waits until Prometheus answers `want` to `query` (scrapes come every 2 s).
    async fn wait_prometheus(&self, query: &str, want: f64) {
        let start = Instant::now();
        loop {
            let got = self.prometheus(query).await;
            if got == Some(want) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(40),
                "Prometheus: {query} = {got:?}, want {want}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{} logs:\n{}", self.project, self.logs());
        }
        let _ = run(&mut self.compose(&["down", "-v", "--remove-orphans", "-t", "3"]));
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

/// Greedy token ids of `prompt` from `base` (12 tokens), or the error body.
async fn greedy(base: &str, prompt: &str) -> Result<Vec<u64>, String> {
    let r = client()
        .post(format!("{base}/v1/completions"))
        .json(
            &json!({"model": "smollm2-135m", "prompt": prompt, "max_tokens": 12,
            "temperature": 0, "return_token_ids": true}),
        )
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status();
    let v: Value = r.json().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{status}: {v}"));
    }
    v["choices"][0]["token_ids"]
        .as_array()
        .map(|ids| ids.iter().filter_map(Value::as_u64).collect())
        .ok_or_else(|| v.to_string())
}

/// The single-instance answers to [`PROMPTS`], from a host process of the binary under test.
async fn reference() -> &'static Vec<Vec<u64>> {
    REFERENCE
        .get_or_init(|| async {
            let single = Server::serve(&[]);
            let mut out = Vec::new();
            for p in PROMPTS {
                out.push(greedy(&single.base, p).await.unwrap());
            }
            out
        })
        .await
}

/// Sum of one summary metric over the instances of `role`.
fn total(summary: &Value, role: &str, key: &str) -> f64 {
    summary["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["role"] == role)
        .map(|i| i["metrics"][key].as_f64().unwrap_or(0.0))
        .sum()
}

/// Waits until every instance of the deployment holds no KV block and runs no request.
async fn wait_all_free(d: &Deployment) {
    let start = Instant::now();
    loop {
        let s = d.summary().await;
        let instances = s["instances"].as_array().unwrap().clone();
        let busy: Vec<String> = instances
            .iter()
            .filter(|i| {
                let m = &i["metrics"];
                i["scraped"] != true
                    || m["kv_free_blocks"] != m["kv_total_blocks"]
                    || m["running"].as_f64() != Some(0.0)
            })
            .map(|i| i.to_string())
            .collect();
        if busy.is_empty() && !instances.is_empty() {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "blocks still held or requests running: {busy:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_serves_verified_answers_and_leaves_nothing() {
    let _serial = SERIAL.lock().await;
    let want = reference().await;
    let d = Deployment::up("demo", None, &[("decode", 2)]);
    // The proxy resolves `decode` to both replicas.
    d.wait_instances("prefill", 1).await;
    d.wait_instances("decode", 2).await;

    let rounds = 2;
    for _ in 0..rounds {
        for (p, want) in PROMPTS.iter().zip(want) {
            assert_eq!(&greedy(&d.proxy(), p).await.unwrap(), want, "{p}");
        }
    }
    let requests = (rounds * PROMPTS.len()) as f64;
    let s = d.summary().await;
    assert_eq!(total(&s, "decode", "loads_verified"), requests, "{s}");
    assert_eq!(total(&s, "decode", "loads_mismatch"), 0.0, "{s}");
    assert_eq!(total(&s, "decode", "loads_unverified"), 0.0, "{s}");
    assert_eq!(total(&s, "prefill", "kv_sends"), requests, "{s}");
    assert!(total(&s, "decode", "kv_bytes") > 0.0, "{s}");
    for replica in s["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["role"] == "decode")
    {
        assert!(
            replica["metrics"]["loads_verified"].as_f64().unwrap() >= 1.0,
            "a decode replica got no request: {s}"
        );
    }
    // Prometheus, in its container, scraped both replicas and holds the verified loads.
    d.wait_prometheus("count(up{job=\"decode\"} == 1)", 2.0)
        .await;
    d.wait_prometheus("count(up == 1)", 4.0).await;
    d.wait_prometheus(
        "sum(tandem:kv_checksum_loads_total{job=\"decode\",verdict=\"verified\"})",
        requests,
    )
    .await;
    d.wait_prometheus(
        "sum(tandem:kv_checksum_sends_total{job=\"prefill\"})",
        requests,
    )
    .await;
    wait_all_free(&d).await;

    // The dashboard, rendered by a real browser.
    let dom = chromium(&[
        "--dump-dom",
        "--virtual-time-budget=4000",
        &format!("{}/dashboard", d.proxy()),
    ]);
    assert!(dom.contains("3 / 3"), "instances healthy tile:\n{dom}");
    assert_eq!(
        dom.matches("<tr>").count(),
        1 + 3,
        "one row per instance:\n{dom}"
    );
    let verified = format!("<b>{}</b>", requests as u64);
    assert!(dom.contains(&verified), "verified tile {verified}:\n{dom}");
    let shot = repo_root().join("target/compose-dashboard.png");
    chromium(
        &[
            "--screenshot=".to_owned() + shot.to_str().unwrap(),
            "--window-size=1280,720".to_owned(),
            "--virtual-time-budget=4000".to_owned(),
            format!("{}/dashboard", d.proxy()),
        ]
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
    );
    assert!(std::fs::metadata(&shot)
        .map(|m| m.len() > 10_000)
        .unwrap_or(false));

    // Non-root, unprivileged containers.
    for id in d.containers(None) {
        let config = run_ok(&mut docker(&[
            "inspect",
            "--format",
            "{{.Config.User}} {{.HostConfig.Privileged}}",
            &id,
        ]));
        assert_eq!(config.trim(), "10001:10001 false", "{id}");
        let processes = run_ok(&mut docker(&["top", &id, "-eo", "pid,uid"]));
        assert!(
            processes
                .lines()
                .skip(1)
                .all(|l| l.split_whitespace().nth(1) == Some("10001")),
            "{id}: {processes}"
        );
    }

    // `down` leaves nothing behind.
    let project = d.project.clone();
    drop(d);
    let label = format!("label=com.docker.compose.project={project}");
    for what in [
        vec!["ps", "-a", "-q", "--filter", &label],
        vec!["network", "ls", "-q", "--filter", &label],
        vec!["volume", "ls", "-q", "--filter", &label],
    ] {
        let left = run_ok(&mut docker(&what));
        assert!(left.trim().is_empty(), "{what:?} after down: {left}");
    }
}

/// Runs headless Chromium (Debian's package) with `args`; returns its stdout.
fn chromium(args: &[&str]) -> String {
    let program = ["chromium", "chromium-browser"]
        .into_iter()
        .find(|p| run(Command::new("which").arg(p)).status.success())
        .expect("Chromium is missing: run scripts/setup.sh");
    let profile = tempfile::tempdir().unwrap();
    run_ok(
        Command::new(program)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                &format!("--user-data-dir={}", profile.path().display()),
            ])
            .args(args),
    )
}

/// The fault deployment: producer leases of 8 s; a consumer that corrupts every load after it
/// arrives (checksums catch it, the prompt is recomputed) and waits 3 s between its granted
/// claim and its READ (the window in which the test cuts it off); short proxy timeouts.
const FAULTS: &str = r#"
services:
  prefill:
    environment:
      TANDEM_KV_TRANSFER_CONFIG: '{"kv_connector":"NixlConnector","kv_role":"kv_producer","enable_kv_checksum":true,"kv_connector_extra_config":{"kv_lease_duration":8}}'
  decode:
    environment:
      TANDEM_KV_TRANSFER_CONFIG: '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","enable_kv_checksum":true,"kv_checksum_fail_closed":true,"kv_load_failure_policy":"recompute","kv_fault_injection":{"kind":"corrupt_byte","probability":1.0,"seed":7},"kv_connector_extra_config":{"load_timeout":6,"handshake_timeout":3,"transport_fault_injection":{"kind":"slow_read","delay":3,"probability":1.0,"seed":1}}}'
  proxy:
    environment:
      TANDEM_PROXY_CONNECT_TIMEOUT_SECS: "2"
      TANDEM_PROXY_PREFILL_TIMEOUT_SECS: "20"
      TANDEM_PROXY_DECODE_FIRST_BYTE_TIMEOUT_SECS: "40"
      TANDEM_PROXY_DECODE_IDLE_TIMEOUT_SECS: "20"
"#;

/// Clients that send requests in a loop until stopped; each outcome with its duration.
struct Load {
    stop: Arc<AtomicBool>,
    outcomes: Arc<StdMutex<Vec<(bool, Duration, String)>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(base: String, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let outcomes = Arc::new(StdMutex::new(Vec::new()));
        let tasks = (0..clients)
            .map(|c| {
                let (stop, outcomes, base) = (stop.clone(), outcomes.clone(), base.clone());
                tokio::spawn(async move {
                    let mut i = 0;
                    while !stop.load(Ordering::SeqCst) {
                        let prompt = PROMPTS[(c + i) % PROMPTS.len()];
                        let start = Instant::now();
                        let r = tokio::time::timeout(REQUEST_BOUND, greedy(&base, prompt)).await;
                        let (ok, what) = match r {
                            Ok(Ok(_)) => (true, String::new()),
                            Ok(Err(e)) => (false, e),
                            Err(_) => (false, "no answer within the bound".to_owned()),
                        };
                        outcomes.lock().unwrap().push((ok, start.elapsed(), what));
                        i += 1;
                    }
                })
            })
            .collect();
        Load {
            stop,
            outcomes,
            tasks,
        }
    }

    /// Stops the clients and returns every outcome.
    async fn finish(self) -> Vec<(bool, Duration, String)> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            t.await.unwrap();
        }
        let out = self.outcomes.lock().unwrap().clone();
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_across_containers() {
    let _serial = SERIAL.lock().await;
    let want = reference().await;
    let d = Deployment::up("faults", Some(FAULTS), &[]);
    d.wait_instances("decode", 1).await;

    // 1. A consumer that corrupts what it loads: every load is a mismatch under fail-closed, the
    //    prompt is recomputed, the answer is still the single instance's; Prometheus counts it.
    let corrupted = 3;
    for (p, want) in PROMPTS.iter().zip(want).take(corrupted) {
        assert_eq!(&greedy(&d.proxy(), p).await.unwrap(), want, "{p}");
    }
    d.wait_prometheus(
        "sum(tandem:kv_checksum_loads_total{job=\"decode\",verdict=\"mismatch\"})",
        corrupted as f64,
    )
    .await;
    d.wait_prometheus(
        "sum(tandem:kv_load_failures_total{job=\"decode\",policy=\"recompute\"})",
        corrupted as f64,
    )
    .await;
    let verified = d
        .prometheus("sum(tandem:kv_checksum_loads_total{job=\"decode\",verdict=\"verified\"})")
        .await;
    assert!(matches!(verified, None | Some(0.0)), "{verified:?}");
    wait_all_free(&d).await;

    // 2. The consumer cut off from the producer between its claim and its READ.
    let before = d.summary().await;
    let failures = |s: &Value| {
        total(s, "decode", "load_failures_recompute") + total(s, "decode", "load_failures_fail")
    };
    let decode = d.containers(Some("decode")).remove(0);
    let network = d.network();
    let base = d.proxy();
    let request = tokio::spawn(async move {
        let start = Instant::now();
        let r = tokio::time::timeout(REQUEST_BOUND, greedy(&base, PROMPTS[3])).await;
        (r, start.elapsed())
    });
    let start = Instant::now();
    loop {
        let s = d.summary().await;
        if total(&s, "decode", "waiting_remote_kv") >= 1.0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no load started: {s}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The claim is an HTTP round trip; the READ comes 3 s after it and may take 6 s
    // (load_timeout). The partition outlasts both: a shorter one only delays the READ (TCP
    // retransmits once the network is back) and the load arrives.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    run_ok(&mut docker(&["network", "disconnect", &network, &decode]));
    tokio::time::sleep(Duration::from_secs(12)).await;
    run_ok(&mut docker(&[
        "network", "connect", "--alias", "decode", &network, &decode,
    ]));
    let (outcome, took) = request.await.unwrap();
    assert!(
        took <= REQUEST_BOUND + Duration::from_secs(1),
        "the request hung: {took:?}"
    );
    eprintln!("request across the partition: {outcome:?} after {took:?}");
    d.wait_instances("decode", 1).await;
    let start = Instant::now();
    loop {
        let s = d.summary().await;
        if failures(&s) > failures(&before) {
            // The load failed by policy without any KV arriving: no checksum verdict was
            // reached for it (every load that arrives here is a mismatch).
            assert_eq!(
                total(&s, "decode", "loads_mismatch"),
                total(&before, "decode", "loads_mismatch"),
                "the READ was not cut: {s}"
            );
            assert_eq!(failures(&s), failures(&before) + 1.0, "{s}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no load failure counted: {s}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // No block held on either side once the producer's lease is over.
    wait_all_free(&d).await;
    assert_eq!(&greedy(&d.proxy(), PROMPTS[0]).await.unwrap(), &want[0]);

    // 3. The prefill container killed under load; back after `compose start`.
    let load = Load::start(d.proxy(), 3);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let prefill = d.containers(Some("prefill")).remove(0);
    run_ok(&mut docker(&["kill", &prefill]));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let outcomes = load.finish().await;
    let failed: Vec<_> = outcomes.iter().filter(|o| !o.0).collect();
    assert!(
        !failed.is_empty(),
        "no request failed with the producer gone: {outcomes:?}"
    );
    for (ok, took, what) in &outcomes {
        assert!(*took <= REQUEST_BOUND, "{ok} {what} after {took:?}");
    }
    // Down: the proxy says so, and refuses at once.
    let health = client()
        .get(format!("{}/health", d.proxy()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 503);
    run_ok(&mut d.compose(&["start", "prefill"]));
    d.wait_healthy(Duration::from_secs(180));
    d.wait_instances("prefill", 1).await;
    for (p, want) in PROMPTS.iter().zip(want) {
        assert_eq!(&greedy(&d.proxy(), p).await.unwrap(), want, "{p}");
    }
    wait_all_free(&d).await;
}
