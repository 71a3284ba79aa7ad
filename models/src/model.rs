//! The interface between the engine and a model: what one forward step takes and returns.
//!
//! A step flattens the tokens of many sequences (prefill chunks and decode tokens alike) into
//! one batch. Invariants the engine guarantees and [`ForwardBatch::validate`] checks:
//! - `token_ids` and `positions`, and each of `slot_mappings`, have one entry per token of the
//!   batch;
//! - each sequence's tokens are the contiguous rows `query_start..query_start + query_len`,
//!   sequences do not overlap, and they are the *last* `query_len` of the `context_len` tokens
//!   the sequence has in the cache after this step (cache index of row `i` is
//!   `context_len - query_len + (i - query_start)`);
//! - each sequence has one block table per KV cache group (indexed by group id), or one table
//!   that every group shares; each covers `context_len` tokens (a sliding-window group's entries
//!   before the window may be [`NULL_BLOCK`]: the model never reads them), and each token's slot
//!   in `slot_mappings[t]` is the slot of its cache index under table `t`.
//!
//! The model writes every token's K and V to its slot before any attention of that layer reads
//! the cache, so a sequence attends to its own new tokens (causally) within the same step.

use tandem_kv_cache::{CacheDtype, KvCacheGroup, KvStorage, NULL_BLOCK};
use tandem_parallel::{ParallelConfig, RankId};

use crate::error::ModelError;
use crate::weights::WeightMode;

/// One sequence's part of a [`ForwardBatch`].
#[derive(Debug, Clone, Copy)]
pub struct SeqBatch<'a> {
    /// First row of this sequence in the flattened batch.
    pub query_start: usize,
    /// Number of rows (new tokens) of this sequence in the batch.
    pub query_len: usize,
    /// Tokens in the cache after this step, the new ones included.
    pub context_len: usize,
    /// Block ids of the sequence per KV cache group (indexed by group id), or one table all
    /// groups share: in table `t`, token `j` lives in `block_tables[t][j / block_size]`.
    pub block_tables: &'a [Vec<u32>],
}

impl<'a> SeqBatch<'a> {
    /// The block table of KV cache group `group`.
    pub fn table(&self, group: usize) -> &'a [u32] {
        tandem_kv_cache::group_table(self.block_tables, group).map_or(&[], Vec::as_slice)
    }
}

/// The tokens of one step, flattened over all scheduled sequences.
#[derive(Debug, Clone, Copy)]
pub struct ForwardBatch<'a> {
    pub token_ids: &'a [u32],
    /// RoPE position of each token.
    pub positions: &'a [usize],
    /// Per block table (see [`SeqBatch::block_tables`]): the cache slot of each token,
    /// `block * block_size + offset`.
    pub slot_mappings: &'a [Vec<usize>],
    pub seqs: &'a [SeqBatch<'a>],
    /// Rows of the flattened batch whose logits are returned, in this order.
    pub logits_indices: &'a [usize],
}

impl<'a> ForwardBatch<'a> {
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// The cache slots of KV cache group `group`'s tokens.
    pub fn slots(&self, group: usize) -> &'a [usize] {
        tandem_kv_cache::group_table(self.slot_mappings, group).map_or(&[], Vec::as_slice)
    }

    /// Checks the invariants of the module docs against a cache with `block_size` tokens per block.
    pub fn validate(&self, block_size: usize, max_positions: usize) -> Result<(), ModelError> {
        let n = self.token_ids.len();
        let bad = |msg: String| Err(ModelError::InvalidBatch(msg));
        if self.positions.len() != n || self.slot_mappings.iter().any(|m| m.len() != n) {
            return bad(format!(
                "{} tokens but {} positions and slot mappings of {:?} tokens",
                n,
                self.positions.len(),
                self.slot_mappings.iter().map(Vec::len).collect::<Vec<_>>()
            ));
        }
        if self.slot_mappings.is_empty() {
            return bad("no slot mapping".into());
        }
        if let Some(s) = self
            .seqs
            .iter()
            .position(|s| s.block_tables.len() != self.slot_mappings.len())
        {
            return bad(format!(
                "sequence {s} has {} block tables for {} slot mappings",
                self.seqs[s].block_tables.len(),
                self.slot_mappings.len()
            ));
        }
        if let Some(&p) = self.positions.iter().find(|&&p| p >= max_positions) {
            return bad(format!(
                "position {p} is beyond the model's {max_positions} positions"
            ));
        }
        let mut covered = vec![false; n];
        for (s, seq) in self.seqs.iter().enumerate() {
            let end = seq.query_start + seq.query_len;
            if end > n {
                return bad(format!(
                    "sequence {s} rows {}..{end} exceed {n}",
                    seq.query_start
                ));
            }
            if seq.query_len > seq.context_len {
                return bad(format!(
                    "sequence {s}: query_len {} > context_len {}",
                    seq.query_len, seq.context_len
                ));
            }
            if let Some(t) = seq
                .block_tables
                .iter()
                .position(|t| t.len() * block_size < seq.context_len)
            {
                return bad(format!(
                    "sequence {s}: {} blocks of table {t} cannot hold {} tokens",
                    seq.block_tables[t].len(),
                    seq.context_len
                ));
            }
            let first = seq.context_len - seq.query_len;
            for (i, row) in (seq.query_start..end).enumerate() {
                if std::mem::replace(&mut covered[row], true) {
                    return bad(format!("row {row} belongs to two sequences"));
                }
                let idx = first + i;
                for (t, (table, slots)) in
                    seq.block_tables.iter().zip(self.slot_mappings).enumerate()
                {
                    let block = table[idx / block_size];
                    if block == NULL_BLOCK {
                        return bad(format!("sequence {s} row {row}: a null block in table {t}"));
                    }
                    let want = block as usize * block_size + idx % block_size;
                    if slots[row] != want {
                        return bad(format!(
                            "sequence {s} row {row}: slot {} but block table {t} says {want}",
                            slots[row]
                        ));
                    }
                }
            }
        }
        if let Some(row) = covered.iter().position(|c| !c) {
            return bad(format!("row {row} belongs to no sequence"));
        }
        if let Some(&r) = self.logits_indices.iter().find(|&&r| r >= n) {
            return bad(format!("logits index {r} out of {n} rows"));
        }
        Ok(())
    }
}

/// Shape and identity of a loaded model, as the engine and server need them.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// Architecture family, e.g. `llama`.
    pub architecture: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    /// The context length the model was trained for (the engine's max model length).
    pub max_position_embeddings: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    /// How the weights are held in memory.
    pub weight_mode: WeightMode,
    /// Bytes of weights the forward pass reads per step (all matrices and the embedding table;
    /// of this rank's shard when the model is split). The other fields describe the whole model.
    pub weight_bytes: usize,
}

/// A causal language model that reads and writes the engine's paged KV cache.
pub trait CausalLm: Send + Sync {
    fn info(&self) -> &ModelInfo;

    /// The KV cache groups this model needs: the engine allocates a [`KvStorage`] from them.
    /// Storage layer `i` (in the order of the groups' layer names) is model layer `i`.
    fn kv_cache_groups(&self, block_size: usize, dtype: CacheDtype) -> Vec<KvCacheGroup>;

    /// Runs one step: writes the K and V of every token of `batch` to its slot, and returns the
    /// logits of the rows `batch.logits_indices`, `[logits_indices.len(), vocab_size]` row-major.
    ///
    /// A rank of a parallel model returns the logits only on the last pipeline stage (every TP
    /// rank of it, gathered); earlier stages return nothing. Every rank of the model must run
    /// the same batch in the same step.
    fn forward(&self, batch: &ForwardBatch, kv: &KvStorage) -> Result<Vec<f32>, ModelError>;

    /// The parallel layout this model is a rank of (TP 1, PP 1 rank 0 for a whole model).
    fn parallel_rank(&self) -> (ParallelConfig, RankId) {
        (ParallelConfig::default(), RankId::default())
    }
}
