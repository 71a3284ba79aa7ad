//! Forward-pass benchmark of the embedded model on the paged KV cache, per weight mode:
//! prefill tok/s (one 200-token prompt), decode tok/s at batch 1, aggregate decode tok/s at
//! batch 16, and the batch-1 decode step time as a ratio to the time of reading the weights
//! once at the memcpy bandwidth measured in the same run.
//!
//! ```text
//! cargo run --release -p tandem-models --example bench_model [-- MODEL [MODES] [STEPS] [KV]]
//! #   MODEL default smollm2-135m, MODES default q8_0,f32,native, STEPS (decode steps) default 32,
//! #   KV (cache dtype) default f32
//! ```
//!
//! A mode may name the instruction set of Tandem's kernels after `@` (`native@portable`,
//! `native@avx2`, `native@avx512`; see `tandem_models::cpu`), so variants compare in one run;
//! without it the process's active set is used. `-novnni` after the set (`native-i8@avx512-novnni`)
//! runs the integer kernels without VNNI instructions (`tandem_models::cpu::Vnni`).

use std::time::Instant;

use tandem_kv_cache::{CacheDtype, KvCacheConfig, KvStorage};
use tandem_models::cpu::{set_vnni_allowed, Isa};
use tandem_models::{load_model, CausalLm, ForwardBatch, LoadOptions, SeqBatch, WeightMode};

/// Prompt tokens of every sequence: `BENCH_PROMPT_LEN`, else 200.
fn prompt_len() -> usize {
    std::env::var("BENCH_PROMPT_LEN")
        .ok()
        .map_or(200, |s| s.parse().expect("BENCH_PROMPT_LEN: a token count"))
}
const BATCH: usize = 16;
const BLOCK: usize = 16;

/// memcpy bandwidth in bytes/s (bytes copied per second), best of several copies of 256 MiB.
fn memcpy_bandwidth() -> f64 {
    let n = 256 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    n as f64 / best
}

struct Seq {
    tokens: Vec<u32>,
    blocks: Vec<u32>,
    cached: usize,
}

/// One step: every sequence in `seqs` schedules its uncached tokens; returns the elapsed time.
fn step(model: &dyn CausalLm, kv: &KvStorage, seqs: &mut [Seq]) -> f64 {
    let (mut ids, mut pos, mut slots, mut last) = (vec![], vec![], vec![], vec![]);
    let mut spans = vec![];
    for s in seqs.iter() {
        let start = ids.len();
        for j in s.cached..s.tokens.len() {
            ids.push(s.tokens[j]);
            pos.push(j);
            slots.push(s.blocks[j / BLOCK] as usize * BLOCK + j % BLOCK);
        }
        last.push(ids.len() - 1);
        spans.push((start, s.tokens.len() - s.cached, s.tokens.len()));
    }
    let sb: Vec<SeqBatch> = seqs
        .iter()
        .zip(&spans)
        .map(|(s, &(start, n, ctx))| SeqBatch {
            query_start: start,
            query_len: n,
            context_len: ctx,
            block_tables: std::slice::from_ref(&s.blocks),
        })
        .collect();
    let batch = ForwardBatch {
        token_ids: &ids,
        positions: &pos,
        slot_mappings: std::slice::from_ref(&slots),
        seqs: &sb,
        logits_indices: &last,
    };
    let t = Instant::now();
    let logits = model.forward(&batch, kv).expect("forward");
    let dt = t.elapsed().as_secs_f64();
    let vocab = model.info().vocab_size;
    drop(sb);
    for (s, row) in seqs.iter_mut().zip(logits.chunks_exact(vocab)) {
        s.cached = s.tokens.len();
        let next = row
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
            .0;
        s.tokens.push(next as u32);
    }
    dt
}

fn prompt(i: usize, len: usize) -> Vec<u32> {
    // deterministic, varied ids from the ordinary vocabulary (skipping the 17 special tokens)
    (0..len)
        .map(|j| 17 + ((i * 7919 + j * 104_729) % 40_000) as u32)
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let spec = args.first().map_or("smollm2-135m", String::as_str);
    let default_isa = Isa::active();
    let modes: Vec<(WeightMode, Isa, bool)> = args
        .get(1)
        .map_or("q8_0,f32,native", String::as_str)
        .split(',')
        .map(|m| {
            let (mode, isa) = m.split_once('@').unwrap_or((m, default_isa.name()));
            let (isa, vnni) = match isa.strip_suffix("-novnni") {
                Some(isa) => (isa, false),
                None => (isa, true),
            };
            let isa = Isa::parse(isa).expect("instruction set: portable, avx2 or avx512");
            (WeightMode::parse(mode).expect("mode"), isa, vnni)
        })
        .collect();
    let steps: usize = args.get(2).map_or(32, |s| s.parse().expect("steps"));
    let kv_dtype = args
        .get(3)
        .map_or(CacheDtype::F32, |s| CacheDtype::parse(s).expect("kv dtype"));
    let bw = memcpy_bandwidth();
    let prompt_tokens = prompt_len();
    println!(
        "memcpy bandwidth {:.2} GB/s; {} threads, prompt {prompt_tokens} tokens, {steps} decode steps, {kv_dtype} KV cache",
        bw / 1e9,
        rayon::current_num_threads()
    );
    println!(
        "| weights | load s | weight MiB | prefill tok/s | decode tok/s (b=1) | decode tok/s (b={BATCH}, aggregate) | b={BATCH}/b=1 | step b=1 ms | weights/memcpy ms | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (mode, isa, vnni) in modes {
        Isa::set_active(isa).expect("instruction set");
        set_vnni_allowed(vnni);
        let vnni_tag = if vnni { "" } else { "-novnni" };
        let t = Instant::now();
        let m = load_model(
            spec,
            &LoadOptions {
                weights: Some(mode),
                ..Default::default()
            },
        )
        .expect("load");
        let load_s = t.elapsed().as_secs_f64();
        let model = m.model();
        let per_seq_blocks = (prompt_tokens + steps + 1).div_ceil(BLOCK);
        let kv = KvStorage::new(&KvCacheConfig {
            num_blocks: per_seq_blocks * (BATCH + 1),
            groups: model.kv_cache_groups(BLOCK, kv_dtype),
        })
        .expect("kv");
        let mut next_block = 0u32;
        let mut new_seq = |i: usize| {
            let blocks = (next_block..next_block + per_seq_blocks as u32).collect();
            next_block += per_seq_blocks as u32;
            Seq {
                tokens: prompt(i, prompt_tokens),
                blocks,
                cached: 0,
            }
        };
        // warm-up (packs quantized tiles, grows thread pools)
        {
            let mut w = [new_seq(99)];
            step(model, &kv, &mut w);
            step(model, &kv, &mut w);
        }
        // prefill: best of 3 runs of one 200-token prompt
        let mut prefill = f64::MAX;
        let mut solo = Vec::new();
        for r in 0..3 {
            let mut s = [Seq {
                tokens: prompt(0, prompt_tokens),
                blocks: (0..per_seq_blocks as u32).collect(),
                cached: 0,
            }];
            prefill = prefill.min(step(model, &kv, &mut s));
            if r == 2 {
                solo = s.into_iter().collect();
            }
        }
        // decode at batch 1
        let mut t1 = 0.0;
        for _ in 0..steps {
            t1 += step(model, &kv, &mut solo);
        }
        if std::env::var_os("BENCH_BATCH1_ONLY").is_some() {
            // for profiling the batch-1 step alone
            println!("| {mode} | batch-1 decode {:.1} tok/s |", steps as f64 / t1);
            continue;
        }
        // decode at batch 16 (each sequence prefilled first, in one batch)
        let mut seqs: Vec<Seq> = (1..=BATCH).map(&mut new_seq).collect();
        step(model, &kv, &mut seqs);
        let mut t16 = 0.0;
        for _ in 0..steps {
            t16 += step(model, &kv, &mut seqs);
        }
        let (d1, d16) = (steps as f64 / t1, (BATCH * steps) as f64 / t16);
        let step_ms = 1e3 * t1 / steps as f64;
        let weights_ms = 1e3 * m.info.weight_bytes as f64 / bw;
        println!(
            "| {mode}@{}{vnni_tag} | {load_s:.2} | {:.0} | {:.0} | {d1:.1} | {d16:.1} | {:.1}x | {step_ms:.2} | {weights_ms:.2} | {:.2} |",
            isa.name(),
            m.info.weight_bytes as f64 / (1 << 20) as f64,
            prompt_tokens as f64 / prefill,
            d16 / d1,
            step_ms / weights_ms
        );
    }
}
