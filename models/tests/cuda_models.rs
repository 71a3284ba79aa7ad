//! The GPU decoder (bf16 on a GPU) against the CPU decoder (f32) on the same files, on a GPU
//! (run by `scripts/gpu_run.sh` on the device machine; CI has no GPU and only builds this).
//!
//! Both run the same batches (three prompts, chunked prefill mixed with decode, then decode),
//! teacher-forced by the CPU's greedy choice. Logits must agree within bf16 tolerance, and the
//! greedy choices wherever the CPU's top two are not a near-tie.
#![cfg(feature = "cuda")]

mod common;

use tandem_kernels::cuda::{Device, KvArrangement};
use tandem_kv_cache::{CacheDtype, KvCacheConfig, KvStorage};
use tandem_models::cuda::{load_gpu_model, GpuCacheOptions, GpuModel};
use tandem_models::loader::LoadFormat;
use tandem_models::{
    load_model, CausalLm, ForwardBatch, LoadOptions, LoadedModel, SeqBatch, WeightMode,
};

const BLOCK: usize = 16;
const BLOCKS: usize = 256;

struct Stats {
    worst_rel: f32,
    compared: usize,
    greedy_checked: usize,
}

/// Runs both models over `prompts` (prefill in chunks of `chunk`, all sequences in every step),
/// `new_tokens` greedy tokens each, and checks every logits row.
fn compare(
    cpu: &LoadedModel,
    gpu: &GpuModel,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    chunk: usize,
    tol: f32,
    tie: f32,
) -> Stats {
    let model: &dyn CausalLm = cpu.ranks[0].as_ref();
    let kv = KvStorage::new(&KvCacheConfig {
        num_blocks: BLOCKS,
        groups: model.kv_cache_groups(BLOCK, CacheDtype::F32),
    })
    .unwrap();
    // Blocks handed out in a scrambled order: 7 is coprime with 256.
    let mut free: Vec<u32> = (0..BLOCKS as u32)
        .map(|i| (i * 7 + 3) % BLOCKS as u32)
        .collect();
    let mut tokens: Vec<Vec<u32>> = prompts.to_vec();
    let mut cached = vec![0usize; prompts.len()];
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut stats = Stats {
        worst_rel: 0.0,
        compared: 0,
        greedy_checked: 0,
    };
    loop {
        let work: Vec<(usize, usize)> = (0..prompts.len())
            .filter(|&s| tokens[s].len() < prompts[s].len() + new_tokens)
            .map(|s| (s, (tokens[s].len() - cached[s]).min(chunk)))
            .collect();
        if work.is_empty() {
            return stats;
        }
        let (mut ids, mut pos, mut slots, mut rows, mut spans) =
            (vec![], vec![], vec![], vec![], vec![]);
        for &(s, n) in &work {
            let end = cached[s] + n;
            while tables[s].len() * BLOCK < end {
                tables[s].push(free.pop().expect("out of blocks"));
            }
            let start = ids.len();
            for j in cached[s]..end {
                ids.push(tokens[s][j]);
                pos.push(j);
                slots.push(tables[s][j / BLOCK] as usize * BLOCK + j % BLOCK);
            }
            rows.push(ids.len() - 1);
            spans.push((s, start, n, end));
        }
        let seqs: Vec<SeqBatch> = spans
            .iter()
            .map(|&(s, start, n, end)| SeqBatch {
                query_start: start,
                query_len: n,
                context_len: end,
                block_tables: std::slice::from_ref(&tables[s]),
            })
            .collect();
        let batch = ForwardBatch {
            token_ids: &ids,
            positions: &pos,
            slot_mappings: std::slice::from_ref(&slots),
            seqs: &seqs,
            logits_indices: &rows,
        };
        let want = model.forward(&batch, &kv).unwrap();
        let got = gpu.forward(&batch).unwrap();
        let vocab = model.info().vocab_size;
        assert_eq!(got.len(), want.len());
        for (i, (w, g)) in want.chunks(vocab).zip(got.chunks(vocab)).enumerate() {
            let scale = w.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1.0);
            let diff = w
                .iter()
                .zip(g)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            stats.worst_rel = stats.worst_rel.max(diff / scale);
            stats.compared += 1;
            assert!(
                diff <= tol * scale,
                "row {i}: logits differ by {diff} (largest |logit| {scale})"
            );
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|&a, &b| w[b].total_cmp(&w[a]));
            if w[order[0]] - w[order[1]] > tie * scale {
                stats.greedy_checked += 1;
                assert_eq!(
                    common::argmax(g),
                    order[0] as u32,
                    "row {i}: the GPU's greedy choice differs (CPU margin {})",
                    w[order[0]] - w[order[1]]
                );
            }
        }
        drop(seqs);
        for (&(s, _, _, end), w) in spans.iter().zip(want.chunks(vocab)) {
            cached[s] = end;
            if end == tokens[s].len() {
                tokens[s].push(common::argmax(w));
            }
        }
    }
}

fn gpu_options(max_tokens: usize) -> GpuCacheOptions {
    GpuCacheOptions {
        num_blocks: BLOCKS,
        block_size: BLOCK,
        arrangement: KvArrangement::BlockMajor,
        max_tokens,
    }
}

#[test]
fn smollm2_in_bf16_on_the_gpu_agrees_with_the_cpu_in_f32() {
    let cpu = common::load(WeightMode::F32)
        .expect("the GPU tests need the embedded model: set TANDEM_MODEL_DIR");
    let dev = Device::open(0).unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e}"));
    let gpu = load_gpu_model(
        "smollm2-135m",
        &LoadOptions::default(),
        &dev,
        gpu_options(256),
    )
    .unwrap();
    let prompts: Vec<Vec<u32>> = [
        "The capital of France is",
        "Write a short poem about the sea, in the style of a sailor who misses home and \
         remembers the harbour lights at night.",
        "1, 2, 3, 4, 5,",
    ]
    .iter()
    .map(|p| cpu.tokenizer.encode(p, true).unwrap())
    .collect();
    let stats = compare(&cpu, &gpu, &prompts, 24, 16, 0.08, 0.02);
    println!(
        "SmolLM2-135M, bf16 GPU vs f32 CPU: {} logits rows, worst |diff| / max |logit| = {:.4}, \
         greedy choice equal on all {} rows with a top-two margin above 2%",
        stats.compared, stats.worst_rel, stats.greedy_checked
    );
    assert!(stats.greedy_checked >= stats.compared / 2);
}

#[test]
fn a_dummy_gqa_model_on_the_gpu_agrees_with_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gqa.json");
    std::fs::write(
        &config,
        serde_json::json!({
            "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
            "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": false
        })
        .to_string(),
    )
    .unwrap();
    let opts = LoadOptions {
        weights: Some(WeightMode::F32),
        format: LoadFormat::Dummy { config },
        ..Default::default()
    };
    let cpu = load_model("gqa", &opts).unwrap();
    let dev = Device::open(0).unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e}"));
    let gpu_opts = LoadOptions {
        weights: None,
        ..opts.clone()
    };
    let gpu = load_gpu_model("gqa", &gpu_opts, &dev, gpu_options(512)).unwrap();
    let prompts: Vec<Vec<u32>> = vec![
        (0..700).map(|i| (i * 37 % 1000) as u32).collect(),
        (0..33).map(|i| (i * 11 % 1000) as u32).collect(),
    ];
    let stats = compare(&cpu, &gpu, &prompts, 8, 256, 0.05, 0.02);
    println!(
        "dummy GQA model: {} rows, worst relative diff {:.4}, {} greedy checks",
        stats.compared, stats.worst_rel, stats.greedy_checked
    );
}
