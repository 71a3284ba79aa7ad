//! Shared helpers of the NIXL tests: KV storages filled with seeded random bytes, byte
//! comparisons of blocks, waiting for notifications, and re-executing the test binary as a
//! helper process (the producer side of two-process tests).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{RngCore, SeedableRng};
use tandem_kv_cache::{CacheDtype, KvCacheConfig, KvCacheGroup, KvCacheSpec, KvPart, KvStorage};
use tandem_kv_connector::nixl::{NixlAgent, NixlAgentConfig};

pub const MODEL: &str = "smollm2-135m";
/// Environment variable that turns a test binary into a helper process.
pub const ROLE_ENV: &str = "TANDEM_NIXL_TEST_ROLE";
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// A storage of `layers` layers with SmolLM2's KV shape (3 KV heads of 64) in `dtype`.
pub fn storage(
    layers: usize,
    num_blocks: usize,
    block_size: usize,
    dtype: CacheDtype,
) -> Arc<KvStorage> {
    let config = KvCacheConfig {
        num_blocks,
        groups: vec![KvCacheGroup {
            group_id: 0,
            spec: KvCacheSpec::FullAttention {
                block_size,
                num_kv_heads: 3,
                head_dim: 64,
                dtype,
            },
            layer_names: (0..layers)
                .map(|i| format!("model.layers.{i}.self_attn"))
                .collect(),
        }],
    };
    Arc::new(KvStorage::new(&config).expect("storage"))
}

/// The default test storage: 4 layers, 32 blocks of 16 tokens, bf16.
pub fn small_storage() -> Arc<KvStorage> {
    storage(4, 32, 16, CacheDtype::Bf16)
}

/// Fills every block of every layer's K and V with bytes drawn from `seed`.
pub fn fill_random(s: &KvStorage, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for layer in 0..s.num_layers() {
        for part in [KvPart::K, KvPart::V] {
            for b in 0..s.layout(layer).num_blocks {
                // SAFETY: the test owns the storage; no transfer is in flight.
                let bytes = unsafe { s.block_bytes_mut(layer, part, b) }.unwrap();
                rng.fill_bytes(bytes);
            }
        }
    }
}

/// The bytes of block `b` of `layer`'s `part`.
pub fn block(s: &KvStorage, layer: usize, part: KvPart, b: usize) -> Vec<u8> {
    let view = s.layer(layer).unwrap();
    let (k, v) = view.block(b).unwrap();
    match part {
        KvPart::K => k.to_vec(),
        KvPart::V => v.to_vec(),
    }
}

/// Asserts that `dst` block `d` equals `src` block `s` for every pair, in every layer and part.
pub fn assert_blocks_equal(src: &KvStorage, dst: &KvStorage, pairs: &[(usize, usize)]) {
    for layer in 0..src.num_layers() {
        for part in [KvPart::K, KvPart::V] {
            for &(s, d) in pairs {
                assert!(
                    block(src, layer, part, s) == block(dst, layer, part, d),
                    "layer {layer} {part:?}: destination block {d} differs from source block {s}"
                );
            }
        }
    }
}

/// Asserts that the listed blocks of `s` are all zero in every layer and part.
pub fn assert_blocks_zero(s: &KvStorage, blocks: impl IntoIterator<Item = usize> + Clone) {
    for layer in 0..s.num_layers() {
        for part in [KvPart::K, KvPart::V] {
            for b in blocks.clone() {
                assert!(
                    block(s, layer, part, b).iter().all(|&x| x == 0),
                    "layer {layer} {part:?} block {b} was written"
                );
            }
        }
    }
}

pub fn agent(engine: &str, storage: Arc<KvStorage>) -> NixlAgent {
    agent_with(NixlAgentConfig::new(engine, MODEL), storage)
}

pub fn agent_with(config: NixlAgentConfig, storage: Arc<KvStorage>) -> NixlAgent {
    NixlAgent::new(config, storage).expect("NIXL agent (did scripts/setup.sh run?)")
}

/// Polls `agent`'s notifications until `n` have arrived or the timeout passes.
pub fn wait_notifs(agent: &NixlAgent, n: usize, timeout: Duration) -> Vec<(String, Vec<u8>)> {
    let start = Instant::now();
    let mut got = Vec::new();
    while got.len() < n && start.elapsed() < timeout {
        got.extend(agent.get_notifs().expect("get_notifs"));
        std::thread::sleep(Duration::from_millis(1));
    }
    got
}

/// A helper process: this test binary re-executed to run the ignored test `entry` with
/// [`ROLE_ENV`] set to `role`, talking over line-based stdin/stdout.
pub struct Helper {
    pub child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Helper {
    pub fn spawn(entry: &str, role: &str, envs: &[(&str, &str)]) -> Helper {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--ignored",
            "--exact",
            entry,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn helper");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Helper {
            child,
            stdin,
            stdout,
        }
    }

    /// The payload of the next line `TAG payload` the helper prints (other lines are libtest's).
    pub fn expect(&mut self, tag: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).expect("read helper");
            assert!(n > 0, "helper exited before printing {tag}");
            // libtest may print `test name ... ` on the same line first.
            let marker = format!("{tag} ");
            if let Some(at) = line.find(&marker) {
                return line[at + marker.len()..].trim_end().to_string();
            }
        }
    }

    pub fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("write helper");
        self.stdin.flush().unwrap();
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        // A failed test must not leave its helper behind.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// In a helper process: the role, or `None` when this is a normal test run.
pub fn role() -> Option<String> {
    std::env::var(ROLE_ENV).ok()
}

/// In a helper process: prints one tagged line for the parent.
pub fn say(tag: &str, payload: &str) {
    println!("\n{tag} {payload}");
    std::io::stdout().flush().unwrap();
}

/// In a helper process: the next line from the parent.
pub fn hear() -> String {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("read parent");
    line.trim_end().to_string()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}
