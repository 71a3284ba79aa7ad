//! Clean shutdown of P/D instances, again and again (30 starts in the test suite; a soak sets
//! `TANDEM_SHUTDOWN_CYCLES`, e.g. 1000): SIGTERM stops `tandem serve` with exit code 0
//! and "stopped" in its log, whether it is a producer or a consumer, idle or just after moving
//! KV over NIXL. The engine thread (and with it the NIXL agent) is torn down before the process
//! exits, never during exit: a process exiting while NIXL is torn down segfaulted in libnixl.so.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Instance starts the test makes unless `TANDEM_SHUTDOWN_CYCLES` says otherwise: enough for every
/// kind of stop (each role idle, both roles after a transfer, in both orders) several times.
const DEFAULT_CYCLES: usize = 30;

fn cycles() -> usize {
    std::env::var("TANDEM_SHUTDOWN_CYCLES").map_or(DEFAULT_CYCLES, |v| {
        v.parse()
            .expect("TANDEM_SHUTDOWN_CYCLES: a number of instance starts")
    })
}

fn config(role: &str) -> String {
    format!(r#"{{"kv_connector":"NixlConnector","kv_role":"{role}"}}"#)
}

struct Instance {
    child: Child,
    port: u16,
    log: std::path::PathBuf,
}

impl Instance {
    fn start(role: &str) -> Instance {
        let port = common::free_port();
        let log = std::env::temp_dir().join(format!("tandem-shutdown-{port}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["serve", "--host", "127.0.0.1", "--port", &port.to_string()])
            // The smallest start: weights as stored, a small cache.
            .args(["--dtype", "native", "--num-kv-blocks", "64"])
            .args(["--kv-transfer-config", &config(role)])
            .current_dir(common::repo_root())
            .env("RUST_LOG", "info")
            .stdout(Stdio::from(f.try_clone().unwrap()))
            .stderr(Stdio::from(f))
            .spawn()
            .unwrap();
        let mut i = Instance { child, port, log };
        let started = Instant::now();
        while common::http_get_status(&i.url("/health")) != Some(200) {
            if let Ok(Some(st)) = i.child.try_wait() {
                panic!("exited with {st} at start:\n{}", i.log_text());
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{}",
                i.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        i
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then the exit status: 0 and "stopped" logged, within 30 s.
    fn terminate(mut self) {
        // SAFETY: sending a signal to our own child process.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let started = Instant::now();
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            if started.elapsed() > Duration::from_secs(30) {
                let _ = self.child.kill();
                panic!("did not stop within 30 s:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let log = self.log_text();
        assert!(status.success(), "exit {status} after SIGTERM:\n{log}");
        assert!(log.contains("stopped"), "{log}");
        let _ = std::fs::remove_file(&self.log);
    }
}

fn post(url: &str, body: &Value) -> Value {
    let r = reqwest::blocking::Client::new()
        .post(url)
        .json(body)
        .timeout(Duration::from_secs(60))
        .send()
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    r.json().unwrap()
}

#[test]
fn sigterm_stops_pd_instances_cleanly_every_time() {
    common::require_model();
    let cycles = cycles();
    let mut starts = 0;
    let mut round = 0;
    while starts < cycles {
        round += 1;
        if round % 5 == 0 {
            // A producer and a consumer that just moved KV over NIXL (peers connected, the
            // consumer's transfer thread and the producer's progress thread busy a moment ago).
            let p = Instance::start("kv_producer");
            let d = Instance::start("kv_consumer");
            let prompt = "The capital of France is";
            let v = post(
                &p.url("/v1/completions"),
                &json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
            );
            let v = post(
                &d.url("/v1/completions"),
                &json!({"prompt": prompt, "max_tokens": 2, "kv_transfer_params": v["kv_transfer_params"]}),
            );
            assert!(v["choices"][0]["text"].is_string(), "{v}");
            if round % 2 == 0 {
                d.terminate();
                p.terminate();
            } else {
                p.terminate();
                d.terminate();
            }
            starts += 2;
        } else {
            let role = if round % 2 == 0 {
                "kv_consumer"
            } else {
                "kv_producer"
            };
            Instance::start(role).terminate();
            starts += 1;
        }
    }
}
