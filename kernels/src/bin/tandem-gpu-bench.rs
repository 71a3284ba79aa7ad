//! GPU benchmark of the fused KV checksum kernel (issue 12): an 8k-token request of the 8B shape
//! (32 layers, 8 KV heads of 128, bf16, blocks of 16) with its blocks scattered through a large
//! device cache, checksummed on the GPU, against device-to-device copies of the same bytes in the
//! same run. Checks the GPU values against the CPU backend first.
//!
//! Usage: `tandem-gpu-bench [--tokens N] [--cache-blocks B] [--iters I] [--arrangement
//! block-major|per-layer]` (run on the GPU machine by `scripts/gpu_run.sh`).

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{result, DevicePtr};
use rand::{Rng, SeedableRng};
use tandem_kernels::cuda::{CudaChecksums, Device, DeviceKvCache, KvArrangement};
use tandem_kv_cache::{BlockLayout, CacheDtype, LayerKv, LayoutOrder};
use tandem_kv_checksum::{BlockJob, ChecksumBackend, CpuBackend, GroupJob, LayerJob};

struct Args {
    tokens: usize,
    cache_blocks: usize,
    iters: usize,
    arrangement: KvArrangement,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        tokens: 8192,
        cache_blocks: 6144,
        iters: 20,
        arrangement: KvArrangement::BlockMajor,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--tokens" => args.tokens = value()?.parse().map_err(|e| format!("--tokens: {e}"))?,
            "--cache-blocks" => {
                args.cache_blocks = value()?
                    .parse()
                    .map_err(|e| format!("--cache-blocks: {e}"))?
            }
            "--iters" => args.iters = value()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--arrangement" => {
                args.arrangement = match value()?.as_str() {
                    "block-major" => KvArrangement::BlockMajor,
                    "per-layer" => KvArrangement::PerLayer,
                    other => return Err(format!("--arrangement: unknown {other}")),
                }
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

fn median(mut xs: Vec<f32>) -> f32 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tandem-gpu-bench: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("tandem-gpu-bench: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    const LAYERS: usize = 32;
    const BLOCK: usize = 16;
    let dev = Device::open(0)?;
    println!("device: {}", dev.name()?);
    let layout = BlockLayout {
        num_blocks: args.cache_blocks,
        block_size: BLOCK,
        kernel_block_size: BLOCK,
        num_kv_heads: 8,
        head_dim: 128,
        dtype: CacheDtype::Bf16,
        order: LayoutOrder::TokenMajor,
    };
    let nblocks = args.tokens.div_ceil(BLOCK);
    if nblocks > args.cache_blocks {
        return Err("the request needs more blocks than the cache has".into());
    }
    let cache = DeviceKvCache::new(&dev, layout, LAYERS, args.arrangement)?;
    cache.fill_pattern(0x7a17)?;
    let bb = layout.block_bytes();
    let cache_gib = (LAYERS * 2 * bb * args.cache_blocks) as f64 / (1u64 << 30) as f64;

    // The request's blocks: distinct, scattered through the pool.
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let mut ids: Vec<usize> = (0..args.cache_blocks).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.random_range(0..=i));
    }
    ids.truncate(nblocks);
    let blocks: Vec<BlockJob> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| BlockJob {
            block_id: id,
            first_slot: 0,
            token_begin: i * BLOCK,
            token_end: ((i + 1) * BLOCK).min(args.tokens),
        })
        .collect();
    let layers: Vec<LayerJob> = (0..LAYERS)
        .map(|l| LayerJob {
            source_index: l,
            layout,
            layer_number: l as u32,
            head_base: 0,
            column: 0,
        })
        .collect();
    let job = GroupJob {
        layers: &layers,
        blocks: &blocks,
        columns: 1,
    };
    let bytes: usize = blocks
        .iter()
        .map(|b| (b.token_end - b.token_begin) * bb / BLOCK * 2 * LAYERS)
        .sum();

    let checksums = CudaChecksums::new(&dev)?;
    let gpu = checksums.launch(&cache, &job, None)?.wait()?;

    // The CPU backend over the same bytes, gathered into a compact host pool.
    let compact = BlockLayout {
        num_blocks: nblocks,
        ..layout
    };
    let mut host: Vec<(Vec<u8>, Vec<u8>)> = Vec::with_capacity(LAYERS);
    for l in 0..LAYERS {
        let mut k = Vec::with_capacity(nblocks * bb);
        let mut v = Vec::with_capacity(nblocks * bb);
        for &id in &ids {
            let (bk, bv) = cache.read_block(l, id)?;
            k.extend_from_slice(&bk);
            v.extend_from_slice(&bv);
        }
        host.push((k, v));
    }
    let views: Vec<LayerKv<'_>> = host
        .iter()
        .map(|(k, v)| LayerKv::new(k, v, compact))
        .collect::<Result<_, _>>()?;
    let compact_layers: Vec<LayerJob> = layers
        .iter()
        .map(|l| LayerJob {
            layout: compact,
            ..l.clone()
        })
        .collect();
    let compact_blocks: Vec<BlockJob> = blocks
        .iter()
        .enumerate()
        .map(|(i, b)| BlockJob { block_id: i, ..*b })
        .collect();
    let mut cpu = vec![0u64; nblocks];
    let t = std::time::Instant::now();
    CpuBackend::new(&views).checksum(
        &GroupJob {
            layers: &compact_layers,
            blocks: &compact_blocks,
            columns: 1,
        },
        &mut cpu,
    )?;
    let cpu_s = t.elapsed().as_secs_f64();
    if gpu != cpu {
        return Err("GPU checksums differ from the CPU backend's".into());
    }
    println!(
        "{nblocks} block checksums equal the CPU backend's (CPU took {:.1} ms on one core)",
        cpu_s * 1e3
    );

    // Timings on the device stream with events.
    let stream = dev.stream().clone();
    let time = |f: &mut dyn FnMut() -> Result<(), Box<dyn std::error::Error>>| -> Result<f32, Box<dyn std::error::Error>> {
        let mut ms = Vec::with_capacity(args.iters);
        for _ in 0..args.iters + 2 {
            let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            f()?;
            let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            end.synchronize()?;
            ms.push(start.elapsed_ms(&end)?);
        }
        Ok(median(ms[2..].to_vec()))
    };
    let checksum_ms = time(&mut || {
        // On the device stream's order: the launch waits for it (None) and the stream then waits
        // for the launch, so the events bracket exactly the checksum work.
        let pending = checksums.launch(&cache, &job, None)?;
        stream.join(checksums.stream())?;
        let values = pending.wait()?;
        debug_assert_eq!(values, cpu);
        Ok(())
    })?;

    // A copy of the same byte count between two buffers of its own (a per-layer cache has no
    // contiguous GiB to read from).
    let source = stream.alloc_zeros::<u8>(bytes)?;
    let scratch = stream.alloc_zeros::<u8>(bytes)?;
    let (src, _sync_src) = source.device_ptr(&stream);
    let (dst, _sync) = scratch.device_ptr(&stream);
    let contiguous_ms = time(&mut || {
        // SAFETY: two buffers of `bytes` each.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }?;
        Ok(())
    })?;
    // The same scattered blocks, copied region by region (block-major: one region per block).
    let scattered_ms = if args.arrangement == KvArrangement::BlockMajor {
        let region = 2 * LAYERS * bb;
        Some(time(&mut || {
            for (i, &id) in ids.iter().enumerate() {
                let src = cache.layers()[0].k + (id * region) as u64;
                // SAFETY: a whole block region of the cache into its own slot of the buffer.
                unsafe {
                    result::memcpy_dtod_async(
                        dst + (i * region) as u64,
                        src,
                        region,
                        stream.cu_stream(),
                    )
                }?;
            }
            Ok(())
        })?)
    } else {
        None
    };

    let gbs = |ms: f32| bytes as f64 / (ms as f64 * 1e-3) / 1e9;
    println!(
        "request: {} tokens, {nblocks} blocks of {BLOCK}, {:.3} GiB of KV scattered in a {:.1} GiB cache ({:?})",
        args.tokens,
        bytes as f64 / (1u64 << 30) as f64,
        cache_gib,
        args.arrangement
    );
    println!(
        "checksum (launch to results in pinned host memory): {checksum_ms:.3} ms, {:.0} GB/s read",
        gbs(checksum_ms)
    );
    println!(
        "device copy, contiguous, same byte count: {contiguous_ms:.3} ms, {:.0} GB/s read ({:.0} GB/s read+written)",
        gbs(contiguous_ms),
        2.0 * gbs(contiguous_ms)
    );
    if let Some(ms) = scattered_ms {
        println!(
            "device copy of the same blocks ({nblocks} regions): {ms:.3} ms, {:.0} GB/s read",
            gbs(ms)
        );
    }
    println!(
        "checksum read rate / contiguous copy read rate: {:.2}",
        gbs(checksum_ms) / gbs(contiguous_ms)
    );
    Ok(())
}
