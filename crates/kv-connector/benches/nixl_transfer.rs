//! KV-block READ bandwidth through the NIXL layer, against a single-threaded memcpy and raw
//! `process_vm_readv` of the same bytes (same pieces, same destination), in one run.
//!
//! The producer is this binary re-executed as a child process (a real process boundary, as in a
//! 1P1D deployment); the parent is the consumer. Block set: SmolLM2-135M's KV shape (30 layers,
//! K and V, 3 KV heads of 64, f32, blocks of 16 tokens = 12 KiB per layer array), 128 blocks
//! (a 2048-token prompt) = 94 MB per transfer, in two patterns:
//! - `contiguous`: remote blocks 0..128 into local 128..256 (NIXL merges them: 60 descriptors);
//! - `scattered`: 128 blocks at random, never adjacent on both sides (7680 descriptors of 12 KiB).
//!
//! Methods are interleaved round by round; medians are reported. Also: the latency of a
//! one-block READ, and the CPU an idle agent burns in 2 s per progress-thread setting.
//!
//! Run: `cargo bench -p tandem-kv-connector --bench nixl_transfer`
//! (env: `ROUNDS`, default 15; `PRODUCER_DELAY_US`, the producer's progress-thread delay).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};
use tandem_kv_cache::{CacheDtype, KvCacheConfig, KvCacheGroup, KvCacheSpec, KvPart, KvStorage};
use tandem_kv_connector::nixl::{
    NixlAgent, NixlAgentConfig, NixlHandshake, DEFAULT_PROGRESS_DELAY_US,
};

const ROLE_ENV: &str = "TANDEM_NIXL_BENCH_ROLE";
const LAYERS: usize = 30;
const NUM_BLOCKS: usize = 256;
const BLOCK_SIZE: usize = 16;
const XFER_BLOCKS: usize = 128;
const MODEL: &str = "smollm2-135m";

/// A piece of a transfer: (remote address, local address, bytes).
type Piece = (usize, usize, usize);

fn storage(layers: usize, num_blocks: usize) -> Arc<KvStorage> {
    let config = KvCacheConfig {
        num_blocks,
        groups: vec![KvCacheGroup {
            group_id: 0,
            spec: KvCacheSpec::FullAttention {
                block_size: BLOCK_SIZE,
                num_kv_heads: 3,
                head_dim: 64,
                dtype: CacheDtype::F32,
            },
            layer_names: (0..layers)
                .map(|i| format!("model.layers.{i}.self_attn"))
                .collect(),
        }],
    };
    Arc::new(KvStorage::new(&config).unwrap())
}

fn fill(s: &KvStorage, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for layer in 0..s.num_layers() {
        for part in [KvPart::K, KvPart::V] {
            for b in 0..s.layout(layer).num_blocks {
                // SAFETY: nothing else touches the storage meanwhile.
                rng.fill_bytes(unsafe { s.block_bytes_mut(layer, part, b) }.unwrap());
            }
        }
    }
}

fn config(engine: &str, progress_thread: bool, delay_us: u64) -> NixlAgentConfig {
    let mut c = NixlAgentConfig::new(engine, MODEL);
    c.progress_thread = progress_thread;
    c.progress_delay_us = delay_us;
    c
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Child: the producer. Prints its handshake, serves READs until stdin closes.
fn producer_main() {
    let mem = storage(LAYERS, NUM_BLOCKS);
    fill(&mem, 7);
    let delay = env_or("PRODUCER_DELAY_US", DEFAULT_PROGRESS_DELAY_US);
    let agent = NixlAgent::new(config("prefill", true, delay), mem).unwrap();
    println!("HANDSHAKE {}", agent.handshake().unwrap().to_json());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// Child: one idle agent with one peer; prints the CPU seconds the process used in 2 s.
fn idle_main() {
    let thread = env_or("IDLE_THREAD", 1) == 1;
    let delay = env_or("IDLE_DELAY_US", 0u64);
    let a = NixlAgent::new(config("idle", thread, delay), storage(1, 8)).unwrap();
    let b = NixlAgent::new(config("peer", true, 100_000), storage(1, 8)).unwrap();
    let peer = a.add_peer(&b.handshake().unwrap()).unwrap();
    a.read_blocks(&peer, &[0], &[1], None)
        .unwrap()
        .wait(Duration::from_secs(10))
        .unwrap();
    drop(b);
    std::thread::sleep(Duration::from_millis(200));
    let before = cpu_seconds();
    std::thread::sleep(Duration::from_secs(2));
    println!("CPU {:.4}", cpu_seconds() - before);
}

/// The pieces of a transfer of `pairs` (remote block, local block), merged like NIXL merges them.
fn pieces(hs: &NixlHandshake, local: &KvStorage, pairs: &[(usize, usize)]) -> Vec<Piece> {
    let regions = local.regions();
    let mut sorted = pairs.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<Piece> = Vec::new();
    for (layer, l) in hs.layers.iter().enumerate() {
        for (part, remote) in [(KvPart::K, l.k), (KvPart::V, l.v)] {
            let dst = regions
                .iter()
                .find(|r| r.layer == layer && r.part == part)
                .unwrap();
            let bb = l.block_bytes;
            let mut prev: Option<(usize, usize)> = None;
            for &(r, d) in &sorted {
                match (prev, out.last_mut()) {
                    (Some((pr, pd)), Some(last)) if r == pr + 1 && d == pd + 1 => last.2 += bb,
                    _ => out.push((remote.addr as usize + r * bb, dst.addr + d * bb, bb)),
                }
                prev = Some((r, d));
            }
        }
    }
    out
}

/// Raw `process_vm_readv` of the pieces, `batch` pieces (at most IOV_MAX = 1024) per call.
fn process_vm_readv(pid: i32, pieces: &[Piece], batch: usize) {
    let iov = |addr: usize, len: usize| libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    for chunk in pieces.chunks(batch) {
        let local: Vec<libc::iovec> = chunk.iter().map(|&(_, l, n)| iov(l, n)).collect();
        let remote: Vec<libc::iovec> = chunk.iter().map(|&(r, _, n)| iov(r, n)).collect();
        let want: usize = chunk.iter().map(|p| p.2).sum();
        // SAFETY: the local iovecs point into our own storage, which nothing else touches now.
        let got = unsafe {
            libc::process_vm_readv(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        assert_eq!(got as usize, want, "{}", std::io::Error::last_os_error());
    }
}

/// memcpy of the same pieces, reading the same offsets of a local storage of the same shape.
fn memcpy(pieces: &[Piece], remote_to_src: &dyn Fn(usize) -> usize) {
    for &(r, l, n) in pieces {
        // SAFETY: both ranges lie in live storages of this process and do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(remote_to_src(r) as *const u8, l as *mut u8, n) };
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    match std::env::var(ROLE_ENV).as_deref() {
        Ok("producer") => return producer_main(),
        Ok("idle") => return idle_main(),
        _ => {}
    }
    let rounds: usize = env_or("ROUNDS", 15);
    let exe = std::env::current_exe().unwrap();

    let mut child = Command::new(&exe)
        .env(ROLE_ENV, "producer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let hs = loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "producer died");
        if let Some(json) = line.trim_end().strip_prefix("HANDSHAKE ") {
            break NixlHandshake::from_json(json).unwrap();
        }
    };

    let dst = storage(LAYERS, NUM_BLOCKS);
    let src = storage(LAYERS, NUM_BLOCKS);
    fill(&src, 7);
    let src_regions = src.regions();
    let map: Vec<(usize, usize, usize)> = hs
        .layers
        .iter()
        .enumerate()
        .flat_map(|(i, l)| {
            let find = |p| {
                src_regions
                    .iter()
                    .find(|r| r.layer == i && r.part == p)
                    .unwrap()
                    .addr
            };
            [
                (l.k.addr as usize, l.k.len as usize, find(KvPart::K)),
                (l.v.addr as usize, l.v.len as usize, find(KvPart::V)),
            ]
        })
        .collect();
    let remote_to_src = move |a: usize| {
        let &(base, _, s) = map
            .iter()
            .find(|&&(b, len, _)| a >= b && a < b + len)
            .unwrap();
        s + (a - base)
    };

    let agents: Vec<(String, NixlAgent)> =
        [(true, DEFAULT_PROGRESS_DELAY_US), (true, 1000), (false, 0)]
            .into_iter()
            .enumerate()
            .filter(|&(i, (_, d))| i == 0 || d != DEFAULT_PROGRESS_DELAY_US)
            .map(|(i, (thread, delay))| {
                let name = match (i, thread) {
                    (0, _) => format!("NIXL (default: progress thread, {} ms)", delay / 1000),
                    (_, true) => format!("NIXL, progress thread, {} ms", delay / 1000),
                    (_, false) => "NIXL, no progress thread".to_string(),
                };
                let a = NixlAgent::new(config(&format!("decode-{i}"), thread, delay), dst.clone())
                    .unwrap();
                a.add_peer(&hs).unwrap();
                (name, a)
            })
            .collect();

    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let contiguous: Vec<(usize, usize)> = (0..XFER_BLOCKS).map(|b| (b, b + 128)).collect();
    let mut evens: Vec<usize> = (0..NUM_BLOCKS).step_by(2).collect();
    evens.shuffle(&mut rng);
    let mut odds: Vec<usize> = (1..NUM_BLOCKS).step_by(2).collect();
    odds.shuffle(&mut rng);
    let scattered: Vec<(usize, usize)> = evens.into_iter().zip(odds).take(XFER_BLOCKS).collect();

    let bytes = (XFER_BLOCKS * LAYERS * 2 * BLOCK_SIZE * 3 * 64 * 4) as f64;
    println!(
        "# READ of {LAYERS} layers x K,V x {XFER_BLOCKS} blocks x {} B = {:.1} MB; \
         {rounds} rounds; {} CPUs; producer progress delay {} us",
        BLOCK_SIZE * 3 * 64 * 4,
        bytes / 1e6,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        env_or("PRODUCER_DELAY_US", DEFAULT_PROGRESS_DELAY_US),
    );
    for (pattern, pairs) in [("contiguous", &contiguous), ("scattered", &scattered)] {
        let p = pieces(&hs, &dst, pairs);
        let remote_ids: Vec<usize> = pairs.iter().map(|x| x.0).collect();
        let local_ids: Vec<usize> = pairs.iter().map(|x| x.1).collect();
        let nixl_read = |a: &NixlAgent| {
            let h = a
                .read_blocks(&a.peers()[0], &local_ids, &remote_ids, None)
                .unwrap();
            let stats = h.wait(Duration::from_secs(30)).unwrap();
            assert_eq!(stats.descriptors, p.len());
            assert_eq!(stats.bytes as f64, bytes);
        };
        // Warm every path up (page faults, connections); check that NIXL got the right bytes.
        memcpy(&p, &remote_to_src);
        process_vm_readv(pid, &p, 1024);
        let probe = p[p.len() / 2];
        // SAFETY: the probe lies in `dst`, which only this thread touches.
        let read_probe = || unsafe { std::slice::from_raw_parts(probe.1 as *const u8, probe.2) };
        let expect = read_probe().to_vec();
        for (_, a) in &agents {
            unsafe { std::ptr::write_bytes(probe.1 as *mut u8, 0, probe.2) };
            nixl_read(a);
            assert!(read_probe() == &expect[..], "NIXL read other bytes");
        }

        let mut names = vec![
            "memcpy, 1 thread".to_string(),
            "process_vm_readv, 1 thread, 1024 pieces per call".to_string(),
            "process_vm_readv, 1 thread, 1 piece per call".to_string(),
        ];
        names.extend(agents.iter().map(|(n, _)| n.clone()));
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
        let mut time = |i: usize, f: &dyn Fn()| {
            let t = Instant::now();
            f();
            times[i].push(t.elapsed().as_secs_f64());
        };
        for _ in 0..rounds {
            time(0, &|| memcpy(&p, &remote_to_src));
            time(1, &|| process_vm_readv(pid, &p, 1024));
            time(2, &|| process_vm_readv(pid, &p, 1));
            for (i, (_, a)) in agents.iter().enumerate() {
                time(3 + i, &|| nixl_read(a));
            }
        }
        let gbps: Vec<(f64, f64, f64)> = times
            .iter_mut()
            .map(|t| {
                let med = median(t);
                (
                    bytes / med / 1e9,
                    bytes / t[t.len() - 1] / 1e9,
                    bytes / t[0] / 1e9,
                )
            })
            .collect();
        println!(
            "\n## READ, {pattern}: {} descriptors of {:.0} KiB on average\n",
            p.len(),
            bytes / p.len() as f64 / 1024.0
        );
        println!("| path | GB/s median | min–max | vs memcpy | vs process_vm_readv (1024/call) |");
        println!("|---|---|---|---|---|");
        for (name, &(med, lo, hi)) in names.iter().zip(&gbps) {
            println!(
                "| {name} | {med:.2} | {lo:.2}–{hi:.2} | {:.2}x | {:.2}x |",
                med / gbps[0].0,
                med / gbps[1].0
            );
        }
    }

    println!("\n## Latency of a one-block READ (60 descriptors of 12 KiB), 200 reads\n");
    println!("| path | median µs | p90 µs |");
    println!("|---|---|---|");
    for (name, a) in &agents {
        let mut t: Vec<f64> = (0..200)
            .map(|i| {
                let t0 = Instant::now();
                a.read_blocks(&a.peers()[0], &[i % 128 + 128], &[i % 128], None)
                    .unwrap()
                    .wait(Duration::from_secs(10))
                    .unwrap();
                t0.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        let med = median(&mut t);
        println!("| {name} | {med:.0} | {:.0} |", t[t.len() * 9 / 10]);
    }
    drop(agents);
    drop(child.stdin.take());
    child.wait().unwrap();

    println!("\n## Idle CPU of a process with one agent (and a finished transfer), 2 s\n");
    println!("| progress thread | CPU seconds in 2 s |");
    println!("|---|---|");
    for (thread, delay) in [
        (true, 0u64),
        (true, 1000),
        (true, 10_000),
        (true, 100_000),
        (false, 0),
    ] {
        let out = Command::new(&exe)
            .env(ROLE_ENV, "idle")
            .env("IDLE_THREAD", if thread { "1" } else { "0" })
            .env("IDLE_DELAY_US", delay.to_string())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let cpu = stdout
            .lines()
            .find_map(|l| l.strip_prefix("CPU "))
            .unwrap_or("?")
            .to_string();
        let what = if thread {
            format!("on, delay {delay} µs")
        } else {
            "off".into()
        };
        println!("| {what} | {cpu} |");
    }
}
