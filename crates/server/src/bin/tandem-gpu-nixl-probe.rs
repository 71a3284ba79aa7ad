//! What one NIXL READ between two processes on one GPU costs per region: the same bytes (an
//! 8k-token prompt's KV of the 8B shape, 1 GiB) moved VRAM to VRAM through Tandem's own NIXL
//! layer and device KV cache, as one region, as k separate regions in one READ, as k READs
//! posted together, and as k READs one after another, and the same as WRITEs (push mode's
//! direction), against a device-to-device copy of the same bytes in the same process and run.
//!
//! The producer is this binary re-executed as a child (a real process boundary, as in 1P1D);
//! the parent is the consumer. Both hold a block-major bf16 cache of `--blocks` blocks of 16
//! tokens (8 KV heads of 128, 32 layers: 2 MiB per block across layers). Run on the GPU machine
//! with `TANDEM_NIXL_LIB_DIR` pointing at the `nixl-cu13` wheel's libraries:
//! `out/gpu/tandem-gpu-nixl-probe [rounds]` (scripts/gpu_nixl_probe.sh does the setup).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_kernels::cuda::{Device, DeviceKvCache, KvArrangement};
use tandem_kv_cache::{
    BlockLayout, CacheDtype, KvCacheConfig, KvCacheGroup, KvCacheSpec, KvStorage, LayoutOrder,
};
use tandem_kv_connector::nixl::{NixlAgent, NixlAgentConfig, NixlHandshake, TransferOp};

const ROLE_ENV: &str = "TANDEM_NIXL_PROBE_ROLE";
const LAYERS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const BLOCK_SIZE: usize = 16;
/// Blocks each transfer moves: 8000 tokens.
const XFER_BLOCKS: usize = 500;
/// Blocks of each side's cache: room for the runs and the gaps between them.
const NUM_BLOCKS: usize = 1100;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn storage(device: &Device) -> Res<Arc<KvStorage>> {
    let layout =
        BlockLayout::token_major(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, CacheDtype::Bf16);
    let cache = DeviceKvCache::new(device, layout, LAYERS, KvArrangement::BlockMajor)?;
    let config = KvCacheConfig {
        num_blocks: NUM_BLOCKS,
        groups: vec![KvCacheGroup {
            group_id: 0,
            spec: KvCacheSpec::FullAttention {
                block_size: BLOCK_SIZE,
                num_kv_heads: KV_HEADS,
                head_dim: HEAD_DIM,
                dtype: CacheDtype::Bf16,
            },
            layer_names: (0..LAYERS)
                .map(|i| format!("model.layers.{i}.self_attn"))
                .collect(),
        }],
    };
    Ok(Arc::new(KvStorage::on_device(
        &config,
        LayoutOrder::TokenMajor,
        &[NUM_BLOCKS],
        Arc::new(cache),
    )?))
}

fn agent(name: &str, storage: Arc<KvStorage>, progress_thread: bool) -> Res<NixlAgent> {
    let mut c = NixlAgentConfig::new(name, "llama-8b-shape");
    c.progress_thread = progress_thread;
    Ok(NixlAgent::new(c, storage)?)
}

fn producer_main() -> Res<()> {
    let device = Device::open(0)?;
    let agent = agent("prefill", storage(&device)?, true)?;
    println!("HANDSHAKE {}", agent.handshake()?.to_json());
    std::io::stdout().flush()?;
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    Ok(())
}

/// `k` runs of the transfer's block ids, a block apart so that no two runs merge; each id names
/// the same block on both sides.
fn runs(k: usize) -> Vec<Vec<usize>> {
    let per = XFER_BLOCKS.div_ceil(k);
    let mut out = Vec::new();
    let mut start = 0;
    let mut left = XFER_BLOCKS;
    while left > 0 {
        let n = per.min(left);
        out.push((start..start + n).collect());
        start += n + 1;
        left -= n;
    }
    out
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Res<()> {
    if std::env::var("UCX_CUDA_IPC_ENABLE_GET_ZCOPY").is_err() {
        // SAFETY: before any thread is started.
        unsafe { std::env::set_var("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y") };
    }
    if std::env::var(ROLE_ENV).as_deref() == Ok("producer") {
        return producer_main();
    }
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let mut child = Command::new(std::env::current_exe()?)
        .env(ROLE_ENV, "producer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
    let hs = loop {
        let mut line = String::new();
        if out.read_line(&mut line)? == 0 {
            return Err("producer died".into());
        }
        if let Some(json) = line.trim_end().strip_prefix("HANDSHAKE ") {
            break NixlHandshake::from_json(json)?;
        }
    };

    let device = Device::open(0)?;
    println!("device: {}", device.name()?);
    let local = storage(&device)?;
    let bytes = (XFER_BLOCKS * LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2) as u64;

    // The device copy of the same bytes, read bytes per second.
    let stream = device.stream().clone();
    let src = stream.alloc_zeros::<u8>(bytes as usize)?;
    let mut dst = stream.alloc_zeros::<u8>(bytes as usize)?;
    let mut copy = Vec::new();
    for i in 0..rounds + 1 {
        stream.synchronize()?;
        let t = Instant::now();
        stream.memcpy_dtod(&src, &mut dst)?;
        stream.synchronize()?;
        if i > 0 {
            copy.push(t.elapsed().as_secs_f64());
        }
    }
    drop((src, dst));
    let copy_s = median(&mut copy);
    println!(
        "{:.1} MiB per transfer; device copy {:.3} ms = {:.0} GB/s; {rounds} rounds, medians",
        bytes as f64 / (1 << 20) as f64,
        copy_s * 1e3,
        bytes as f64 / copy_s / 1e9
    );
    println!("\n| consumer | how | regions | transfers | ms | of which posting | GB/s | ÷ copy |");
    println!("|---|---|---|---|---|---|---|---|");

    let wait = Duration::from_secs(30);
    for progress_thread in [false, true] {
        let a = agent("decode", local.clone(), progress_thread)?;
        let peer = a.add_peer(&hs)?;
        let consumer = if progress_thread {
            "progress thread"
        } else {
            "no progress thread"
        };
        // (op, how, k): one transfer of k regions; k transfers posted together; k in turn.
        // A WRITE moves this side's blocks into the producer's (push mode's direction).
        for (op, how, k) in [
            (TransferOp::Read, "one", 1),
            (TransferOp::Read, "one", 2),
            (TransferOp::Read, "one", 8),
            (TransferOp::Read, "one", 18),
            (TransferOp::Read, "one", 64),
            (TransferOp::Read, "together", 2),
            (TransferOp::Read, "together", 4),
            (TransferOp::Read, "together", 8),
            (TransferOp::Read, "together", 16),
            (TransferOp::Read, "together", 32),
            (TransferOp::Read, "in turn", 2),
            (TransferOp::Read, "in turn", 8),
            (TransferOp::Write, "one", 1),
            (TransferOp::Write, "one", 8),
            (TransferOp::Write, "together", 8),
            (TransferOp::Write, "together", 16),
            (TransferOp::Write, "in turn", 8),
        ] {
            let r = runs(k);
            let all = r.concat();
            let post_one = |ids: &[usize]| match op {
                TransferOp::Read => a.read_blocks(&peer, ids, ids, None),
                TransferOp::Write => a.write_blocks(&peer, ids, ids, None),
            };
            let (mut times, mut posts) = (Vec::new(), Vec::new());
            for i in 0..rounds + 1 {
                let t = Instant::now();
                // (descriptors, transfers, seconds spent creating and posting)
                let (regions, transfers, post) = match how {
                    "one" => {
                        let s = post_one(&all)?.wait(wait)?;
                        (s.descriptors, 1, s.post_duration.as_secs_f64())
                    }
                    "together" => {
                        let hs = r
                            .iter()
                            .map(|ids| post_one(ids))
                            .collect::<Result<Vec<_>, _>>()?;
                        let (mut d, mut p) = (0, 0.0);
                        for h in hs {
                            let s = h.wait(wait)?;
                            d += s.descriptors;
                            p += s.post_duration.as_secs_f64();
                        }
                        (d, k, p)
                    }
                    _ => {
                        let (mut d, mut p) = (0, 0.0);
                        for ids in &r {
                            let s = post_one(ids)?.wait(wait)?;
                            d += s.descriptors;
                            p += s.post_duration.as_secs_f64();
                        }
                        (d, k, p)
                    }
                };
                if i > 0 {
                    times.push(t.elapsed().as_secs_f64());
                    posts.push(post);
                }
                if i == rounds {
                    let s = median(&mut times);
                    println!(
                        "| {consumer} | {} {how} | {regions} | {transfers} | {:.3} | {:.3} | {:.0} | {:.2}x |",
                        op.name(),
                        s * 1e3,
                        median(&mut posts) * 1e3,
                        bytes as f64 / s / 1e9,
                        copy_s / s
                    );
                }
            }
        }
    }
    drop(child.stdin.take());
    child.wait()?;
    Ok(())
}
