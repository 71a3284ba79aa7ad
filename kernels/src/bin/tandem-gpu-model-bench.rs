//! GPU benchmark of the decoder on Llama 3.1 8B's shape with random bf16 weights (issue 12):
//! decode step time at batch 1 against the time to read the weights once at the measured
//! device-copy bandwidth, eager and as a CUDA graph; batch-N decode throughput; where a batch-1
//! step's time goes (the matrix products alone); and the TTFT of a long prefill with the fused KV
//! checksum on and off, interleaved in one run.
//!
//! Usage: `tandem-gpu-model-bench [--ctx 1024] [--batch 32] [--steps 50] [--prefill 8192]
//! [--chunk 2048] [--reps 5]` (run on the GPU machine by `scripts/gpu_run.sh`).

use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{result, CudaEvent, DevicePtr};
use tandem_kernels::cuda::{
    Blas, CudaChecksums, DecoderShape, Device, DeviceKvCache, GpuDecoder, KvArrangement, Output,
    OwnedStep, Weights,
};
use tandem_kv_cache::{BlockLayout, CacheDtype};
use tandem_kv_checksum::{BlockJob, GroupJob, LayerJob};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const BLOCK: usize = 16;

struct Args {
    ctx: usize,
    batch: usize,
    steps: usize,
    prefill: usize,
    chunk: usize,
    reps: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        ctx: 1024,
        batch: 32,
        steps: 50,
        prefill: 8192,
        chunk: 2048,
        reps: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v: usize = it
            .next()
            .ok_or(format!("{flag} needs a value"))?
            .parse()
            .map_err(|e| format!("{flag}: {e}"))?;
        match flag.as_str() {
            "--ctx" => a.ctx = v,
            "--batch" => a.batch = v,
            "--steps" => a.steps = v,
            "--prefill" => a.prefill = v,
            "--chunk" => a.chunk = v,
            "--reps" => a.reps = v,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.ctx == 0 || a.batch == 0 || a.steps == 0 || a.chunk == 0 || a.reps == 0 {
        return Err("every size must be positive".into());
    }
    Ok(a)
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tandem-gpu-model-bench: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("tandem-gpu-model-bench: {e}");
        std::process::exit(1);
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

/// A sequence of the benchmark: its block table and how many tokens it has in the cache.
struct Seq {
    table: Vec<u32>,
    len: usize,
}

/// One step in which each sequence adds `counts[i]` tokens (token ids a fixed function of the
/// position).
fn step(seqs: &[&Seq], counts: &[usize], vocab: usize) -> OwnedStep {
    let mut s = OwnedStep::default();
    for (seq, &count) in seqs.iter().zip(counts) {
        let ids: Vec<u32> = (seq.len..seq.len + count)
            .map(|i| ((i * 7919) % vocab) as u32)
            .collect();
        s.push_sequence(&seq.table, BLOCK, seq.len, &ids);
    }
    s
}

fn event(dev: &Device) -> Res<CudaEvent> {
    Ok(dev
        .stream()
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// Median device time (ms) of `f` over `n` runs, each between two events, after 3 warm-ups.
fn time_each(dev: &Device, n: usize, f: &mut dyn FnMut() -> Res<()>) -> Res<f64> {
    let mut ms = Vec::with_capacity(n);
    for i in 0..n + 3 {
        let start = event(dev)?;
        f()?;
        let end = event(dev)?;
        end.synchronize()?;
        if i >= 3 {
            ms.push(f64::from(start.elapsed_ms(&end)?));
        }
    }
    Ok(median(ms))
}

fn run(args: &Args) -> Res<()> {
    let dev = Device::open(0)?;
    println!("device: {}", dev.name()?);
    let stream = dev.stream().clone();

    // Device-copy bandwidth, bytes read per second.
    let copy_bytes = 2usize << 30;
    let src = stream.alloc_zeros::<u8>(copy_bytes)?;
    let dst = stream.alloc_zeros::<u8>(copy_bytes)?;
    let copy_ms = {
        let (s, _a) = src.device_ptr(&stream);
        let (d, _b) = dst.device_ptr(&stream);
        time_each(&dev, 10, &mut || {
            // SAFETY: two buffers of `copy_bytes`.
            unsafe { result::memcpy_dtod_async(d, s, copy_bytes, stream.cu_stream()) }?;
            Ok(())
        })?
    };
    drop((src, dst));
    let copy_gbs = copy_bytes as f64 / (copy_ms * 1e-3) / 1e9;
    println!(
        "device copy of 2 GiB: {copy_ms:.3} ms, {copy_gbs:.0} GB/s read ({:.0} GB/s read+written)",
        2.0 * copy_gbs
    );

    let mut shape = DecoderShape::llama_8b();
    shape.max_positions = (args.ctx + args.steps + 16).max(args.prefill + 16);
    let theta = 500_000f32;
    let inv: Vec<f32> = (0..shape.head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / shape.head_dim as f32))
        .collect();
    let per_seq = (args.ctx + args.steps + 8).div_ceil(BLOCK);
    let prefill_blocks = args.prefill.div_ceil(BLOCK);
    let num_blocks = args.batch * per_seq + prefill_blocks;
    let layout = BlockLayout::token_major(
        num_blocks,
        BLOCK,
        shape.kv_heads,
        shape.head_dim,
        CacheDtype::Bf16,
    );
    let cache = DeviceKvCache::new(&dev, layout, shape.layers, KvArrangement::BlockMajor)?;
    let t0 = Instant::now();
    let max_tokens = args.chunk.max(args.batch);
    let dec = GpuDecoder::new(
        &dev,
        shape.clone(),
        &inv,
        cache,
        max_tokens,
        Weights::Random { seed: 1 },
    )?;
    let wbytes = shape.weight_bytes();
    println!(
        "8B shape, random bf16 weights: {:.2} GB of weights, cache {num_blocks} blocks of {BLOCK} \
         (block-major, {:.1} GiB), loaded in {:.1} s",
        wbytes as f64 / 1e9,
        (layout.total_bytes() * 2 * shape.layers) as f64 / (1u64 << 30) as f64,
        t0.elapsed().as_secs_f64()
    );

    // Sequences for decode, blocks scattered (interleaved between sequences), prefilled to ctx.
    let mut seqs: Vec<Seq> = (0..args.batch)
        .map(|s| Seq {
            table: (0..per_seq).map(|b| (b * args.batch + s) as u32).collect(),
            len: 0,
        })
        .collect();
    for seq in seqs.iter_mut() {
        while seq.len < args.ctx {
            let n = (args.ctx - seq.len).min(max_tokens);
            dec.enqueue_step(&step(&[seq], &[n], shape.vocab).input())?;
            seq.len += n;
        }
    }
    stream.synchronize()?;

    let roofline_ms = wbytes as f64 / (copy_gbs * 1e9) * 1e3;
    for batch in [1, args.batch] {
        let group: Vec<&Seq> = seqs[..batch].iter().collect();
        let ones = vec![1; batch];
        let decode = step(&group, &ones, shape.vocab);
        // The same step again and again (rewrites the same slots): a steady-state decode step.
        let eager = time_each(&dev, args.steps, &mut || {
            dec.enqueue_step(&decode.input())?;
            Ok(())
        })?;
        let graph = dec.capture(&decode.input())?;
        let graphed = time_each(&dev, args.steps, &mut || {
            dec.replay_queued(&graph, &decode.input())?;
            Ok(())
        })?;
        // Back to back, as an engine runs them: wall time per step, logits copied to the host.
        let wall = {
            let t = Instant::now();
            for _ in 0..args.steps {
                dec.replay(&graph, &decode.input())?;
            }
            t.elapsed().as_secs_f64() * 1e3 / args.steps as f64
        };
        println!(
            "decode batch {batch} at context {}: eager {eager:.3} ms, CUDA graph {graphed:.3} ms \
             per step (device time); with logits to the host {wall:.3} ms wall; {:.0} tokens/s",
            args.ctx,
            batch as f64 / (graphed * 1e-3)
        );
        if batch == 1 {
            println!(
                "  weights read once at the copy's rate: {roofline_ms:.3} ms; the graphed step \
                 reaches {:.0}% of that roofline (eager {:.0}%)",
                100.0 * roofline_ms / graphed,
                100.0 * roofline_ms / eager
            );
        }
    }

    // Where a batch-1 step goes: the same products alone, on buffers of their own.
    {
        let blas = Blas::new(&dev)?;
        let (h, i) = (shape.hidden, shape.intermediate);
        let qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim;
        let mats = [
            (qkv, h),
            (h, shape.heads * shape.head_dim),
            (2 * i, h),
            (h, i),
        ];
        let layer_elems: usize = mats.iter().map(|(r, c)| r * c).sum();
        let w = stream.alloc_zeros::<u16>(layer_elems * shape.layers + shape.vocab * h)?;
        let x = stream.alloc_zeros::<u16>(2 * i)?;
        let y = stream.alloc_zeros::<f32>(shape.vocab)?;
        let (wp, _a) = w.device_ptr(&stream);
        let (xp, _b) = x.device_ptr(&stream);
        let (yp, _c) = y.device_ptr(&stream);
        let products = time_each(&dev, args.steps, &mut || {
            let mut at = wp;
            for _ in 0..shape.layers {
                for &(r, c) in &mats {
                    // SAFETY: `w` holds every matrix back to back; x and y hold the widest row.
                    unsafe { blas.matmul(xp, c, at, yp, r, (1, r, c), Output::Bf16) }?;
                    at += 2 * (r * c) as u64;
                }
            }
            unsafe { blas.matmul(xp, h, at, yp, shape.vocab, (1, shape.vocab, h), Output::F32) }?;
            Ok(())
        })?;
        println!(
            "  the step's {} matrix products alone (batch 1, eager): {products:.3} ms, {:.0} GB/s",
            4 * shape.layers + 1,
            wbytes as f64 / (products * 1e-3) / 1e9
        );
    }

    // TTFT of a long prefill in chunks, the KV checksum of each chunk's finished blocks on a side
    // stream after the chunk's event (on) or not (off), interleaved.
    let checksums = CudaChecksums::new(&dev)?;
    let base = (args.batch * per_seq) as u32;
    let mut prefill = Seq {
        table: (0..prefill_blocks as u32).map(|b| base + b).collect(),
        len: 0,
    };
    let layers: Vec<LayerJob> = (0..shape.layers)
        .map(|l| LayerJob {
            source_index: l,
            layout,
            layer_number: l as u32,
            head_base: 0,
            column: 0,
        })
        .collect();
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for rep in 0..2 * args.reps + 2 {
        let with_checksums = rep % 2 == 1;
        prefill.len = 0;
        stream.synchronize()?;
        let t = Instant::now();
        let mut pending = Vec::new();
        let mut logits = Vec::new();
        while prefill.len < args.prefill {
            let n = (args.prefill - prefill.len).min(args.chunk);
            let chunk = step(&[&prefill], &[n], shape.vocab);
            let last = prefill.len + n == args.prefill;
            if last {
                logits = dec.forward(&chunk.input())?;
            } else {
                dec.enqueue_step(&chunk.input())?;
            }
            if with_checksums {
                let done = stream.record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
                let first_block = prefill.len / BLOCK;
                let end = prefill.len + n;
                let blocks: Vec<BlockJob> = (first_block..end.div_ceil(BLOCK))
                    .map(|b| BlockJob {
                        block_id: prefill.table[b] as usize,
                        first_slot: 0,
                        token_begin: b * BLOCK,
                        token_end: ((b + 1) * BLOCK).min(end),
                    })
                    .collect();
                let job = GroupJob {
                    layers: &layers,
                    blocks: &blocks,
                    columns: 1,
                };
                pending.push(checksums.launch(dec.cache(), &job, Some(&done))?);
            }
            prefill.len += n;
        }
        let ttft = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(logits.len(), shape.vocab);
        for p in pending {
            p.wait()?;
        }
        if rep >= 2 {
            if with_checksums { &mut on } else { &mut off }.push(ttft);
        }
    }
    let (on, off) = (median(on), median(off));
    println!(
        "prefill of {} tokens in chunks of {} (TTFT, logits on the host): checksums off {off:.1} ms, \
         on {on:.1} ms: overhead {:+.2}% (medians of {} interleaved runs each)",
        args.prefill,
        args.chunk,
        100.0 * (on - off) / off,
        args.reps
    );
    Ok(())
}
