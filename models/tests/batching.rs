//! Continuous batching must not change a request's result: a sequence decoded alone and the
//! same sequence decoded among others (prefill chunks and decode tokens of several sequences in
//! one step) give the same greedy ids and (near-)identical logits, in every weight mode and
//! cache dtype.

mod common;

use common::{fixture, greedy_batched, ids, Cache};
use tandem_kv_cache::CacheDtype;
use tandem_models::{CausalLm, WeightMode};

const NEW_TOKENS: usize = 12;

fn prompts() -> Vec<Vec<u32>> {
    let fx = fixture("reference_greedy.json");
    let cases = fx["cases"].as_array().unwrap();
    // chat and raw prompts of 4 to 216 tokens
    [0, 4, 6, 9, 11]
        .iter()
        .map(|&i| ids(&cases[i]["prompt_ids"]))
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn solo_vs_batched(model: &dyn CausalLm, dtype: CacheDtype) -> f32 {
    let prompts = prompts();
    let mut worst = 0f32;
    let mut batched_cache = Cache::new(model, 16, 64, dtype);
    // chunks of 7 tokens: prompts finish prefill at different steps, so most steps mix
    // prefill chunks with decode tokens
    let (batched, batched_logits) =
        greedy_batched(model, &mut batched_cache, &prompts, NEW_TOKENS, 7);
    for (i, p) in prompts.iter().enumerate() {
        let mut cache = Cache::new(model, 16, 64, dtype);
        let (solo, solo_logits) = greedy_batched(
            model,
            &mut cache,
            std::slice::from_ref(p),
            NEW_TOKENS,
            1 << 20,
        );
        assert_eq!(
            solo[0].generated(),
            batched[i].generated(),
            "prompt {i}: greedy ids differ between solo and batched ({dtype})"
        );
        for (a, b) in solo_logits[0].iter().zip(&batched_logits[i]) {
            worst = worst.max(max_abs_diff(a, b));
        }
    }
    worst
}

#[test]
fn batched_equals_solo_q8_0() {
    let Some(m) = common::load(WeightMode::Q8_0) else {
        return;
    };
    for dtype in [CacheDtype::F32, CacheDtype::Bf16] {
        let d = solo_vs_batched(m.model(), dtype);
        eprintln!("q8_0 weights, {dtype} cache: max |solo - batched| logit = {d:e}");
        assert_eq!(d, 0.0, "{dtype}: quantized matmuls are row-independent");
    }
}

/// f32 matmuls (gemm) may sum in a different order for different batch sizes: ~1e-4 apart in
/// the logits; a 16-bit cache can round such a difference either way (~1e-2).
#[test]
fn batched_equals_solo_f32() {
    let Some(m) = common::load(WeightMode::F32) else {
        return;
    };
    for dtype in [CacheDtype::F32, CacheDtype::F16] {
        let d = solo_vs_batched(m.model(), dtype);
        eprintln!("f32 weights, {dtype} cache: max |solo - batched| logit = {d:e}");
        let tol = if dtype == CacheDtype::F32 { 1e-3 } else { 5e-2 };
        assert!(d <= tol, "{dtype}: {d}");
    }
}
