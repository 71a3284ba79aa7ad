//! NIXL across processes: this test binary re-executes itself as a producer (`helper_*` tests,
//! ignored in normal runs), so a READ crosses a process boundary as in a real deployment. Also:
//! a producer killed under a transfer, a missing library (the process must not abort), and the
//! idle CPU of an agent.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tandem_kv_cache::KvStorage;
use tandem_kv_connector::nixl::{NixlAgent, NixlAgentConfig, NixlHandshake};
use tandem_kv_connector::KvConnectorError;

const PRODUCER_SEED: u64 = 42;

/// Helper: a producer over `small_storage()` filled from `PRODUCER_SEED`. Prints its handshake,
/// then every notification it receives, until one says `bye` (or a minute passes).
#[test]
#[ignore = "helper process of the two-process tests"]
fn helper_producer() {
    if role().as_deref() != Some("producer") {
        return;
    }
    let mem = small_storage();
    fill_random(&mem, PRODUCER_SEED);
    let producer = agent("prefill", mem);
    say("HANDSHAKE", &producer.handshake().unwrap().to_json());
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        for (from, bytes) in producer.get_notifs().unwrap() {
            say("NOTIF", &format!("{from} {}", hex(&bytes)));
            if bytes == b"bye" {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Helper: tries to create an agent in a process where NIXL cannot be found.
#[test]
#[ignore = "helper process of the two-process tests"]
fn helper_no_library() {
    if role().as_deref() != Some("nolib") {
        return;
    }
    match NixlAgent::new(NixlAgentConfig::new("e", MODEL), small_storage()) {
        Ok(_) => say("OK", "agent created"),
        Err(e) => say("ERR", &e.to_string()),
    }
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Helper: the CPU an idle agent (default config) burns in 2 s.
#[test]
#[ignore = "helper process of the two-process tests"]
fn helper_idle_cpu() {
    if role().as_deref() != Some("idle") {
        return;
    }
    let a = agent("idle", small_storage());
    let peer = agent("idle-peer", small_storage());
    a.add_peer(&peer.handshake().unwrap()).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let before = cpu_seconds();
    std::thread::sleep(Duration::from_secs(2));
    say("CPU", &format!("{:.4}", cpu_seconds() - before));
}

fn connect_to(helper: &mut Helper, consumer: &NixlAgent) -> String {
    let hs = NixlHandshake::from_json(&helper.expect("HANDSHAKE")).unwrap();
    consumer.add_peer(&hs).unwrap()
}

#[test]
fn two_processes_read_scrambled_blocks_and_notify() {
    let mut helper = Helper::spawn("helper_producer", "producer", &[]);
    let c_mem = small_storage();
    let consumer = agent("decode", c_mem.clone());
    let peer = connect_to(&mut helper, &consumer);

    let remote = [31, 2, 3, 4, 0, 16];
    let local = [0, 12, 13, 14, 31, 5];
    let h = consumer
        .read_blocks(&peer, &local, &remote, Some(b"done\x00req-1".to_vec()))
        .unwrap();
    let stats = h.wait(TIMEOUT).unwrap();
    assert_eq!(stats.descriptors, 4 * 4 * 2);

    let expected = small_storage();
    fill_random(&expected, PRODUCER_SEED);
    let pairs: Vec<(usize, usize)> = remote.iter().copied().zip(local).collect();
    assert_blocks_equal(&expected, &c_mem, &pairs);
    assert_blocks_zero(&c_mem, (0..32).filter(|b| !local.contains(b)));

    let notif = helper.expect("NOTIF");
    assert_eq!(
        notif,
        format!("{} {}", consumer.name(), hex(b"done\x00req-1"))
    );
    consumer.send_notif(&peer, b"bye").unwrap();
    helper.expect("NOTIF");
    assert!(helper.child.wait().unwrap().success());
}

#[test]
fn a_killed_producer_process_fails_the_read_without_hanging() {
    let mut helper = Helper::spawn("helper_producer", "producer", &[]);
    let consumer = agent("decode", small_storage());
    let peer = connect_to(&mut helper, &consumer);
    consumer
        .read_blocks(&peer, &[0], &[0], None)
        .unwrap()
        .wait(TIMEOUT)
        .unwrap();
    helper.child.kill().unwrap();
    helper.child.wait().unwrap();

    let start = Instant::now();
    let outcome = consumer
        .read_blocks(&peer, &[1, 2, 3, 4], &[1, 2, 3, 4], Some(b"x".to_vec()))
        .and_then(|h| h.wait(Duration::from_secs(30)));
    let waited = start.elapsed();
    match outcome {
        Err(KvConnectorError::TransferFailed {
            peer: p, reason, ..
        }) => {
            assert_eq!(p, peer);
            eprintln!("killed producer: failed after {waited:?}: {reason}");
        }
        other => panic!("expected a failed transfer, got {other:?} after {waited:?}"),
    }
    // The consumer's agent keeps working with other peers.
    let producer2 = agent("prefill-2", small_storage());
    let peer2 = consumer.add_peer(&producer2.handshake().unwrap()).unwrap();
    consumer
        .read_blocks(&peer2, &[5], &[5], None)
        .unwrap()
        .wait(TIMEOUT)
        .unwrap();
}

#[test]
fn a_missing_library_is_an_error_not_an_abort() {
    // 1. TANDEM_NIXL_LIB_DIR names a directory without the library.
    let mut helper = Helper::spawn(
        "helper_no_library",
        "nolib",
        &[("TANDEM_NIXL_LIB_DIR", "/nonexistent/nixl-libs")],
    );
    let msg = helper.expect("ERR");
    assert!(
        msg.starts_with("NIXL library not found: looked in /nonexistent/nixl-libs"),
        "{msg}"
    );
    assert!(
        msg.contains("scripts/setup.sh or set TANDEM_NIXL_LIB_DIR"),
        "{msg}"
    );
    assert!(helper.child.wait().unwrap().success());

    // 2. Nothing set, run from a directory tree without `.nixl/`: the search fails cleanly.
    let dir = std::env::temp_dir().join(format!("tandem-nolib-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("copy-of-test-binary");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    let out = std::process::Command::new(&exe)
        .args([
            "--ignored",
            "--exact",
            "helper_no_library",
            "--nocapture",
            "--test-threads=1",
        ])
        .current_dir(&dir)
        .env(ROLE_ENV, "nolib")
        .env_remove("TANDEM_NIXL_LIB_DIR")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "helper died: {out:?}");
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("ERR "))
        .unwrap_or_else(|| panic!("no ERR line in {stdout}"));
    assert!(line.contains("NIXL library not found: looked in"), "{line}");
    assert!(
        line.contains("current directory") && line.contains("executable"),
        "{line}"
    );
}

#[test]
fn an_idle_agent_uses_little_cpu() {
    let mut helper = Helper::spawn("helper_idle_cpu", "idle", &[]);
    let cpu: f64 = helper.expect("CPU").parse().unwrap();
    assert!(helper.child.wait().unwrap().success());
    eprintln!("two idle agents with a peer: {cpu:.3} s CPU in 2 s");
    assert!(cpu < 0.3, "idle agents burned {cpu} s of CPU in 2 s");
}

/// The storage helper and the producer agree on what the producer's blocks hold.
#[test]
fn the_seeded_fill_is_deterministic() {
    let a: std::sync::Arc<KvStorage> = small_storage();
    let b = small_storage();
    fill_random(&a, PRODUCER_SEED);
    fill_random(&b, PRODUCER_SEED);
    assert_blocks_equal(&a, &b, &[(0, 0), (31, 31)]);
}
