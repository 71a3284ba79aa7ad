//! Faults of whole processes under a steady load of concurrent streamed requests through the
//! proxy (1P1D, real NIXL): SIGKILL of the producer, the consumer or the proxy mid-load, and a
//! producer stopped (SIGSTOP) past the consumer's timeouts. For each:
//! - every client gets an answer or an error (status or SSE error event, then `[DONE]`) within
//!   the configured timeouts: none hangs;
//! - no block leaks on a survivor (leases expire, loads fail and recompute or are released);
//! - the proxy takes the dead instance out of rotation and back after a restart (or SIGCONT),
//!   and answers again;
//! - the metrics count what happened (load failures, lease expiries, proxy outcomes).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Server;
use futures::StreamExt;
use serde_json::json;

const PRODUCER: &str = r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer","enable_kv_checksum":true,"kv_connector_extra_config":{"kv_lease_duration":4}}"#;
const CONSUMER: &str = r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","enable_kv_checksum":true,"kv_checksum_fail_closed":true,"kv_load_failure_policy":"recompute","kv_connector_extra_config":{"load_timeout":4,"handshake_timeout":2}}"#;
/// The longest a request may take under any of these faults: the proxy's prefill timeout (10 s)
/// plus a load timeout, plus decoding.
const REQUEST_BOUND: Duration = Duration::from_secs(40);
const CLIENTS: usize = 6;
/// One deployment at a time (the tests' timing bounds assume the machine is theirs).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Answered,
    Failed,
}

/// Concurrent clients, each streaming requests in a loop until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    outcomes: Arc<Mutex<Vec<(Outcome, Duration, String)>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

async fn one_request(client: &reqwest::Client, base: &str, i: usize) -> (Outcome, String) {
    let prompt = format!("Request {i}: write a short line about the sea and the wind.");
    let r = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": true}))
        .send()
        .await;
    let r = match r {
        Ok(r) => r,
        Err(e) => return (Outcome::Failed, format!("connect: {e}")),
    };
    if !r.status().is_success() {
        return (Outcome::Failed, format!("status {}", r.status()));
    }
    let mut body = String::new();
    let mut s = r.bytes_stream();
    while let Some(c) = s.next().await {
        match c {
            Ok(c) => body.push_str(&String::from_utf8_lossy(&c)),
            Err(e) => return (Outcome::Failed, format!("body: {e}")),
        }
    }
    let done = body.contains("data: [DONE]");
    let error = body.contains("\"error\"");
    match (done, error) {
        (true, false) => (Outcome::Answered, String::new()),
        (true, true) => (Outcome::Failed, "error event, then [DONE]".into()),
        (false, _) => (
            Outcome::Failed,
            format!("stream ended without [DONE]: {body:?}"),
        ),
    }
}

impl Load {
    fn start(base: &str) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..CLIENTS)
            .map(|c| {
                let (stop, outcomes, base) = (stop.clone(), outcomes.clone(), base.to_string());
                tokio::spawn(async move {
                    let client = reqwest::Client::builder()
                        .timeout(REQUEST_BOUND + Duration::from_secs(20))
                        .build()
                        .unwrap();
                    let mut i = c * 1000;
                    while !stop.load(Ordering::Relaxed) {
                        let t = Instant::now();
                        let (o, why) = one_request(&client, &base, i).await;
                        outcomes.lock().unwrap().push((o, t.elapsed(), why));
                        if o == Outcome::Failed {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
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

    fn answered(&self) -> usize {
        let o = self.outcomes.lock().unwrap();
        o.iter().filter(|(x, _, _)| *x == Outcome::Answered).count()
    }

    /// Waits until `n` more requests were answered (the deployment serves again).
    async fn until_answered(&self, n: usize, within: Duration) {
        let target = self.answered() + n;
        let t = Instant::now();
        while self.answered() < target {
            assert!(
                t.elapsed() < within,
                "no answers within {within:?}: {:?}",
                self.outcomes
                    .lock()
                    .unwrap()
                    .iter()
                    .rev()
                    .take(5)
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the clients; returns (answered, failed), having checked that none hung.
    async fn finish(self) -> (usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            tokio::time::timeout(REQUEST_BOUND + Duration::from_secs(30), t)
                .await
                .expect("a client hung")
                .unwrap();
        }
        let o = self.outcomes.lock().unwrap();
        for (x, took, why) in o.iter() {
            assert!(*took < REQUEST_BOUND, "{x:?} after {took:?}: {why}");
        }
        let answered = o.iter().filter(|(x, _, _)| *x == Outcome::Answered).count();
        (answered, o.len() - answered)
    }
}

fn start_producer(port: Option<u16>) -> Server {
    let args = ["--kv-transfer-config", PRODUCER];
    match port {
        Some(p) => Server::start_on(None, "127.0.0.1", p, "serve", &args, &[]),
        None => Server::serve(&args),
    }
}

fn start_consumer(port: Option<u16>) -> Server {
    let args = ["--kv-transfer-config", CONSUMER];
    match port {
        Some(p) => Server::start_on(None, "127.0.0.1", p, "serve", &args, &[]),
        None => Server::serve(&args),
    }
}

fn start_proxy(p: &Server, d: &Server, port: Option<u16>) -> Server {
    let args = [
        "--prefill",
        &p.base,
        "--decode",
        &d.base,
        "--prefill-timeout-secs",
        "10",
        "--decode-first-byte-timeout-secs",
        "20",
        "--decode-idle-timeout-secs",
        "10",
        "--health-check-interval-secs",
        "0.5",
        "--health-check-timeout-secs",
        "0.5",
        "--connect-timeout-secs",
        "1",
    ];
    match port {
        Some(port) => Server::start_on(None, "127.0.0.1", port, "proxy", &args, &[]),
        None => Server::start("proxy", &args, &[]),
    }
}

/// The proxy's requests that did not end `ok`, summed over routes and outcomes.
async fn proxy_failures(proxy: &Server) -> f64 {
    let text = reqwest::get(proxy.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with("tandem:proxy_requests_total{") && !l.contains("outcome=\"ok\""))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

async fn healthy(proxy: &Server, role: &str) -> Option<f64> {
    let d = proxy
        .metric("tandem:proxy_upstream_healthy", &[("role", role)])
        .await;
    d
}

async fn wait_healthy(proxy: &Server, role: &str, want: f64) {
    let t = Instant::now();
    while healthy(proxy, role).await != Some(want) {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "{role} healthy != {want}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A 1P1D deployment behind the proxy under the clients' load, already answering.
async fn under_load() -> (Server, Server, Server, Load) {
    let p = start_producer(None);
    let d = start_consumer(None);
    let proxy = start_proxy(&p, &d, None);
    let load = Load::start(&proxy.base);
    load.until_answered(4, Duration::from_secs(60)).await;
    (p, d, proxy, load)
}

/// Waits for answers again, stops the load and checks what every fault must leave: no request
/// beyond its bound (in `finish`), answers before and after, at least one failure.
async fn recovers(load: Load) {
    load.until_answered(4, Duration::from_secs(60)).await;
    let (answered, failed) = load.finish().await;
    assert!(
        answered >= 8 && failed >= 1,
        "{answered} answered, {failed} failed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_producer_mid_load() {
    let _serial = SERIAL.lock().await;
    let (p, d, proxy, load) = under_load().await;
    let port = p.port;
    p.signal(libc::SIGKILL);
    drop(p);
    wait_healthy(&proxy, "prefill", 0.0).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let p = start_producer(Some(port));
    wait_healthy(&proxy, "prefill", 1.0).await;
    recovers(load).await;
    assert!(
        proxy_failures(&proxy).await >= 1.0,
        "the proxy counts the failed requests"
    );
    common::wait_all_free(&[&d, &p]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_consumer_mid_load() {
    let _serial = SERIAL.lock().await;
    let (p, d, proxy, load) = under_load().await;
    let port = d.port;
    d.signal(libc::SIGKILL);
    drop(d);
    wait_healthy(&proxy, "decode", 0.0).await;
    // The producer's blocks for requests that will never be read: released by the proxy when the
    // decode call failed, or freed at lease expiry (4 s).
    common::wait_all_free(&[&p]).await;
    let d = start_consumer(Some(port));
    wait_healthy(&proxy, "decode", 1.0).await;
    recovers(load).await;
    let mid_stream = proxy
        .metric(
            "tandem:proxy_requests_total",
            &[("outcome", "decode_failed_mid_stream")],
        )
        .await
        .unwrap_or(0.0);
    let released = proxy
        .metric("tandem:proxy_kv_releases_total", &[])
        .await
        .unwrap_or(0.0);
    let expired = p
        .metric("tandem:kv_lease_expired_total", &[])
        .await
        .unwrap_or(0.0);
    assert!(
        mid_stream + released + expired >= 1.0,
        "the failures are counted: {mid_stream} mid-stream, {released} released, {expired} expired"
    );
    common::wait_all_free(&[&p, &d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_proxy_mid_load() {
    let _serial = SERIAL.lock().await;
    let (p, d, proxy, load) = under_load().await;
    let port = proxy.port;
    proxy.signal(libc::SIGKILL);
    drop(proxy);
    // Orphaned decodes see their client gone and abort; unread leases expire.
    tokio::time::sleep(Duration::from_secs(1)).await;
    common::wait_all_free(&[&p, &d]).await;
    let proxy = start_proxy(&p, &d, Some(port));
    recovers(load).await;
    drop(proxy);
    common::wait_all_free(&[&p, &d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_stopped_past_the_timeouts_and_continued() {
    let _serial = SERIAL.lock().await;
    let (p, d, proxy, load) = under_load().await;
    p.signal(libc::SIGSTOP);
    wait_healthy(&proxy, "prefill", 0.0).await;
    // Past the consumer's handshake and load timeouts and the proxy's prefill timeout.
    tokio::time::sleep(Duration::from_secs(12)).await;
    p.signal(libc::SIGCONT);
    wait_healthy(&proxy, "prefill", 1.0).await;
    recovers(load).await;
    assert!(
        proxy_failures(&proxy).await >= 1.0,
        "the proxy counts the failed requests"
    );
    common::wait_all_free(&[&p, &d]).await;
}
