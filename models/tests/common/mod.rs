//! Shared helpers of the integration tests: finding the real model, and a tiny "engine" that
//! allocates blocks and drives `CausalLm::forward` with continuous batching (chunked prefill
//! and decode of many sequences in one step), greedy sampling.
#![allow(dead_code)]

use tandem_kv_cache::{CacheDtype, KvCacheConfig, KvStorage};
use tandem_models::{
    load_model, resolve_model, CausalLm, ForwardBatch, LoadOptions, LoadedModel, SeqBatch,
    WeightMode,
};

/// Loads the embedded default model, or returns `None` (after saying so) when its file is absent.
pub fn load(weights: WeightMode) -> Option<LoadedModel> {
    load_named("smollm2-135m", weights)
}

/// Loads embedded model `name`, or returns `None` (after saying so) when its file is absent.
pub fn load_named(name: &str, weights: WeightMode) -> Option<LoadedModel> {
    let opts = LoadOptions {
        weights: Some(weights),
        ..Default::default()
    };
    if let Err(e) = resolve_model(name, &opts) {
        eprintln!("SKIPPED: the model file is absent ({e}); run scripts/setup.sh");
        return None;
    }
    Some(load_model(name, &opts).expect("load the embedded model"))
}

pub fn fixture(name: &str) -> serde_json::Value {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).expect(&path)).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// A KV cache for `model` with `num_blocks` blocks, handed out from a scrambled order so
/// sequences get non-contiguous block tables.
pub struct Cache {
    pub kv: KvStorage,
    pub block_size: usize,
    free: Vec<u32>,
}

impl Cache {
    pub fn new(
        model: &dyn CausalLm,
        block_size: usize,
        num_blocks: usize,
        dtype: CacheDtype,
    ) -> Self {
        let kv = KvStorage::new(&KvCacheConfig {
            num_blocks,
            groups: model.kv_cache_groups(block_size, dtype),
        })
        .unwrap();
        // a fixed permutation: a step coprime with num_blocks visits every block once
        let gcd = |mut a: usize, mut b: usize| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        let step = (5..).find(|&s| gcd(s, num_blocks) == 1).unwrap();
        let free = (0..num_blocks as u32)
            .map(|i| (i * step as u32 + 1) % num_blocks as u32)
            .rev()
            .collect();
        Cache {
            kv,
            block_size,
            free,
        }
    }
}

/// One sequence: its tokens (prompt then generated), how many are in the cache, its blocks.
#[derive(Debug, Clone)]
pub struct Seq {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub cached: usize,
    pub blocks: Vec<u32>,
}

impl Seq {
    pub fn new(prompt: Vec<u32>) -> Self {
        Seq {
            prompt_len: prompt.len(),
            tokens: prompt,
            cached: 0,
            blocks: Vec::new(),
        }
    }
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

/// Runs one step over `work`: `(sequence, number of its next uncached tokens)`. Returns the
/// logits of each sequence's last scheduled token.
pub fn step(
    model: &dyn CausalLm,
    cache: &mut Cache,
    seqs: &mut [Seq],
    work: &[(usize, usize)],
) -> Vec<Vec<f32>> {
    let bs = cache.block_size;
    let (mut token_ids, mut positions, mut slots, mut logits_idx) =
        (vec![], vec![], vec![], vec![]);
    let mut spans = Vec::new();
    for &(s, n) in work {
        let seq = &mut seqs[s];
        let end = seq.cached + n;
        assert!(end <= seq.tokens.len());
        while seq.blocks.len() * bs < end {
            seq.blocks.push(cache.free.pop().expect("out of KV blocks"));
        }
        let start = token_ids.len();
        for j in seq.cached..end {
            token_ids.push(seq.tokens[j]);
            positions.push(j);
            slots.push(seq.blocks[j / bs] as usize * bs + j % bs);
        }
        logits_idx.push(token_ids.len() - 1);
        spans.push((s, start, n, end));
    }
    let seq_batches: Vec<SeqBatch> = spans
        .iter()
        .map(|&(s, start, n, end)| SeqBatch {
            query_start: start,
            query_len: n,
            context_len: end,
            block_tables: std::slice::from_ref(&seqs[s].blocks),
        })
        .collect();
    let batch = ForwardBatch {
        token_ids: &token_ids,
        positions: &positions,
        slot_mappings: std::slice::from_ref(&slots),
        seqs: &seq_batches,
        logits_indices: &logits_idx,
    };
    let logits = model.forward(&batch, &cache.kv).expect("forward");
    drop(seq_batches);
    for &(s, _, _, end) in &spans {
        seqs[s].cached = end;
    }
    let vocab = model.info().vocab_size;
    assert_eq!(logits.len(), work.len() * vocab);
    logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
}

/// Greedy decoding of `prompts` together, `new_tokens` each (EOS not special), prefill in chunks
/// of at most `chunk` tokens, every sequence scheduled in every step (prefill chunks and decode
/// tokens mixed). Returns the sequences and, per sequence, the logits of every generated step.
pub fn greedy_batched(
    model: &dyn CausalLm,
    cache: &mut Cache,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    chunk: usize,
) -> (Vec<Seq>, Vec<Vec<Vec<f32>>>) {
    let mut seqs: Vec<Seq> = prompts.iter().cloned().map(Seq::new).collect();
    let mut step_logits = vec![Vec::new(); seqs.len()];
    loop {
        let work: Vec<(usize, usize)> = seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.generated().len() < new_tokens)
            .map(|(i, s)| (i, (s.tokens.len() - s.cached).min(chunk)))
            .collect();
        if work.is_empty() {
            break;
        }
        let logits = step(model, cache, &mut seqs, &work);
        for (&(s, _), row) in work.iter().zip(logits) {
            if seqs[s].cached == seqs[s].tokens.len() {
                let next = argmax(&row);
                seqs[s].tokens.push(next);
                step_logits[s].push(row);
            }
        }
    }
    (seqs, step_logits)
}
