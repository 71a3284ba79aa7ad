//! Tensor- and pipeline-parallel shards against the whole model: the ranks of a layout, each
//! with its own KV storage and running on its own thread, meet in the CPU collectives and must
//! give the TP 1 logits (f32: only the summation order differs) and greedy ids, where a flip is
//! accepted only at a near-tie (the whole model's top-two margin under `NEAR_TIE`).

mod common;

use common::{greedy_batched, Cache};
use tandem_kv_cache::{CacheDtype, KvCacheConfig, KvCacheGroup, KvStorage};
use tandem_models::{
    load_model, resolve_model, CausalLm, ForwardBatch, LoadFormat, LoadOptions, LoadedModel,
    ModelError, ModelInfo, ParallelConfig, WeightMode,
};

const NEAR_TIE: f32 = 0.1;
/// Largest accepted |logit difference| at matched steps (f32, summation order only).
const LOGIT_TOLERANCE: f32 = 2e-3;
const BLOCK: usize = 16;

/// All ranks of a layout behind the one-model interface the test harness drives: each rank has
/// its own KV storage (the harness's storage is not used), and the logits are the sampling
/// rank's (TP rank 0 of the last stage).
struct Ranks {
    loaded: LoadedModel,
    kvs: Vec<KvStorage>,
    parallel: ParallelConfig,
}

impl Ranks {
    fn new(loaded: LoadedModel, parallel: ParallelConfig, num_blocks: usize) -> Self {
        let kvs = loaded
            .ranks
            .iter()
            .map(|m| {
                KvStorage::new(&KvCacheConfig {
                    num_blocks,
                    groups: m.kv_cache_groups(BLOCK, CacheDtype::F32),
                })
                .unwrap()
            })
            .collect();
        Ranks {
            loaded,
            kvs,
            parallel,
        }
    }
}

impl CausalLm for Ranks {
    fn info(&self) -> &ModelInfo {
        &self.loaded.info
    }
    fn kv_cache_groups(&self, block_size: usize, dtype: CacheDtype) -> Vec<KvCacheGroup> {
        self.loaded.ranks[0].kv_cache_groups(block_size, dtype)
    }
    fn forward(&self, batch: &ForwardBatch, _unused: &KvStorage) -> Result<Vec<f32>, ModelError> {
        let outs: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .loaded
                .ranks
                .iter()
                .zip(&self.kvs)
                .map(|(m, kv)| s.spawn(move || m.forward(batch, kv)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let driver = self.parallel.index(self.parallel.driver());
        for (i, o) in outs.iter().enumerate() {
            let o = o.as_ref().unwrap_or_else(|e| panic!("rank {i}: {e}"));
            let (_, rank) = self.loaded.ranks[i].parallel_rank();
            if rank.pp_rank + 1 < self.parallel.pp {
                assert!(o.is_empty(), "rank {i} of an early stage returned logits");
            }
        }
        outs.into_iter().nth(driver).unwrap()
    }
}

fn prompts(m: &LoadedModel) -> Vec<Vec<u32>> {
    [
        "The capital of France is",
        "def fibonacci(n):",
        "List three colours of the rainbow:",
        "In 1969, the first humans",
    ]
    .iter()
    .map(|p| m.tokenizer.encode(p, true).unwrap())
    .collect()
}

/// Greedy ids and logits of `layout` against the whole model's; returns the matched steps.
fn compare(opts: &LoadOptions, spec: &str, layout: ParallelConfig, new_tokens: usize) -> usize {
    let whole = load_model(spec, opts).unwrap();
    let prompts = prompts(&whole);
    let blocks: usize = prompts
        .iter()
        .map(|p| (p.len() + new_tokens).div_ceil(BLOCK))
        .sum::<usize>()
        + 4;
    let mut cache = Cache::new(whole.model(), BLOCK, blocks, CacheDtype::F32);
    let (want, want_logits) = greedy_batched(whole.model(), &mut cache, &prompts, new_tokens, 7);

    let sharded = load_model(
        spec,
        &LoadOptions {
            parallel: layout,
            ..opts.clone()
        },
    )
    .unwrap();
    assert_eq!(sharded.ranks.len(), layout.world_size());
    let ranks = Ranks::new(sharded, layout, blocks);
    let mut cache = Cache::new(&ranks, BLOCK, blocks, CacheDtype::F32);
    let (got, got_logits) = greedy_batched(&ranks, &mut cache, &prompts, new_tokens, 7);

    let mut matched = 0;
    let mut max_dev = 0f32;
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        let (w, g) = (w.generated(), g.generated());
        let diverged = w.iter().zip(g).position(|(a, b)| a != b);
        let until = diverged.unwrap_or(w.len());
        for s in 0..until {
            let dev = want_logits[i][s]
                .iter()
                .zip(&got_logits[i][s])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            max_dev = max_dev.max(dev);
        }
        matched += until;
        if let Some(s) = diverged {
            let mut row = want_logits[i][s].clone();
            row.sort_by(|a, b| b.total_cmp(a));
            let margin = row[0] - row[1];
            assert!(
                margin < NEAR_TIE,
                "{layout:?} prompt {i} step {s}: {} instead of {} with a top-two margin of {margin}",
                g[s],
                w[s]
            );
            eprintln!("{layout:?} prompt {i}: near-tie flip at step {s} (margin {margin})");
        }
    }
    eprintln!("{layout:?}: {matched} steps matched, max |logit difference| {max_dev:e}");
    assert!(
        max_dev < LOGIT_TOLERANCE,
        "{layout:?}: logits differ by {max_dev}"
    );
    matched
}

fn smollm2_f32() -> Option<LoadOptions> {
    let opts = LoadOptions {
        weights: Some(WeightMode::F32),
        ..Default::default()
    };
    if let Err(e) = resolve_model("smollm2-135m", &opts) {
        eprintln!("SKIPPED: the model file is absent ({e}); run scripts/setup.sh");
        return None;
    }
    Some(opts)
}

#[test]
fn tp3_pp2_and_both_give_the_tp1_answers() {
    let Some(opts) = smollm2_f32() else { return };
    for (tp, pp) in [(3, 1), (1, 2), (3, 2)] {
        let matched = compare(
            &opts,
            "smollm2-135m",
            ParallelConfig::new(tp, pp).unwrap(),
            12,
        );
        assert!(
            matched >= 40,
            "TP {tp} PP {pp}: only {matched} of 48 steps matched"
        );
    }
}

/// Gemma 3 270M has one KV head: at TP 2 both ranks hold a copy of it, and each rank half of the
/// query heads and of the sliding-window and full-attention layers' work.
#[test]
fn gemma3_tp2_replicates_its_single_kv_head_and_gives_the_tp1_answers() {
    let opts = LoadOptions {
        weights: Some(WeightMode::F32),
        ..Default::default()
    };
    if let Err(e) = resolve_model("gemma3-270m", &opts) {
        eprintln!("SKIPPED: the model file is absent ({e}); run scripts/setup.sh");
        return;
    }
    let matched = compare(&opts, "gemma3-270m", ParallelConfig::new(2, 1).unwrap(), 12);
    assert!(matched >= 40, "only {matched} of 48 steps matched");
}

/// A dummy model with 8 query heads and 2 KV heads: at TP 4 each KV head is on two ranks.
fn dummy_opts(dir: &std::path::Path) -> LoadOptions {
    let config = dir.join("gqa-8x2.json");
    std::fs::write(
        &config,
        serde_json::json!({
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": false
        })
        .to_string(),
    )
    .unwrap();
    LoadOptions {
        weights: Some(WeightMode::F32),
        format: LoadFormat::Dummy { config },
        ..Default::default()
    }
}

#[test]
fn replicated_kv_heads_at_tp4_give_the_tp1_answers() {
    let dir = tempfile::tempdir().unwrap();
    let opts = dummy_opts(dir.path());
    let m = load_model("gqa", &opts).unwrap();
    assert_eq!(
        m.tokenizer.encode("hi", true).unwrap().len(),
        3,
        "BOS + 2 bytes"
    );
    let tp4 = ParallelConfig::new(4, 1).unwrap();
    let sharded = load_model(
        "gqa",
        &LoadOptions {
            parallel: tp4,
            ..opts.clone()
        },
    )
    .unwrap();
    for r in &sharded.ranks {
        let groups = r.kv_cache_groups(BLOCK, CacheDtype::F32);
        assert_eq!(groups[0].spec.num_kv_heads(), 1, "one KV head per rank");
    }
    let matched = compare(&opts, "gqa", tp4, 12);
    assert!(matched >= 40, "only {matched} of 48 steps matched");
    compare(&opts, "gqa", ParallelConfig::new(2, 2).unwrap(), 8);
}

#[test]
fn layouts_that_do_not_split_are_refused_with_the_reason() {
    let Some(opts) = smollm2_f32() else { return };
    let err = load_model(
        "smollm2-135m",
        &LoadOptions {
            parallel: ParallelConfig::new(2, 1).unwrap(),
            ..opts.clone()
        },
    )
    .expect_err("TP 2 does not split 9 heads");
    assert!(err.to_string().contains("attention heads (9)"), "{err}");
    let err = load_model(
        "smollm2-135m",
        &LoadOptions {
            parallel: ParallelConfig::new(1, 31).unwrap(),
            ..opts
        },
    )
    .expect_err("31 stages for 30 layers");
    assert!(err.to_string().contains("pipeline stages"), "{err}");
}
