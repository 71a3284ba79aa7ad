//! What the GPU decoder takes from the engine, decided on the host: which models it computes
//! exactly as the CPU decoder does ([`gpu_supports`]: the Llama family) and a [`ForwardBatch`]
//! translated into its step arrays ([`gpu_step`]).
//!
//! Plain Rust, built with or without the `cuda` feature (its tests need no GPU and no CUDA
//! toolchain); `crate::cuda` calls it.
//!
//! Invariant: a batch is validated ([`ForwardBatch::validate`]) before it is translated, and
//! every index it carries fits the u32 the kernels read.

use tandem_kernels::step::OwnedStep;

use crate::decoder::{Activation, DecoderConfig};
use crate::error::ModelError;
use crate::model::ForwardBatch;

/// Refuses what the GPU decoder does not compute (everything but the Llama family).
pub fn gpu_supports(cfg: &DecoderConfig) -> Result<(), ModelError> {
    let f = &cfg.features;
    if f.qk_norm
        || f.post_norms
        || f.activation != Activation::Silu
        || f.layer_windows.iter().any(Option::is_some)
        || f.embed_scale.is_some()
        || f.attn_scale.is_some()
    {
        return Err(ModelError::Unsupported(format!(
            "the GPU decoder runs the Llama family only, not `{}`",
            f.arch
        )));
    }
    Ok(())
}

/// Translates `batch` (validated first; one KV cache group) into the GPU decoder's step arrays
/// for a cache of `block_size`-token blocks.
pub fn gpu_step(
    batch: &ForwardBatch<'_>,
    block_size: usize,
    max_positions: usize,
) -> Result<OwnedStep, ModelError> {
    batch.validate(block_size, max_positions)?;
    if batch.slot_mappings.len() != 1 {
        return Err(ModelError::InvalidBatch(format!(
            "the GPU decoder has one KV cache group, the batch {}",
            batch.slot_mappings.len()
        )));
    }
    let u32_of = |v: usize, what: &str| {
        u32::try_from(v).map_err(|_| ModelError::InvalidBatch(format!("{what} {v} > u32")))
    };
    let all = |values: &[usize], what: &str| -> Result<Vec<u32>, ModelError> {
        values.iter().map(|&v| u32_of(v, what)).collect()
    };
    let n = batch.num_tokens();
    let mut step = OwnedStep {
        token_ids: batch.token_ids.to_vec(),
        positions: all(batch.positions, "position")?,
        slots: all(batch.slots(0), "slot")?,
        ctx_idx: vec![0; n],
        table_off: vec![0; n],
        tables: Vec::new(),
        logits_rows: all(batch.logits_indices, "logits row")?,
    };
    for seq in batch.seqs {
        let off = u32_of(step.tables.len(), "table offset")?;
        step.tables.extend_from_slice(seq.table(0));
        let first = seq.context_len - seq.query_len;
        for i in 0..seq.query_len {
            step.ctx_idx[seq.query_start + i] = u32_of(first + i, "cache index")?;
            step.table_off[seq.query_start + i] = off;
        }
    }
    Ok(step)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::Features;
    use crate::model::SeqBatch;

    fn llama() -> DecoderConfig {
        DecoderConfig {
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            vocab_size: 100,
            max_position_embeddings: 256,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            features: Features::llama(),
        }
    }

    #[test]
    fn only_the_llama_family_is_taken() {
        assert!(gpu_supports(&llama()).is_ok());
        let mut gemma_like = llama();
        gemma_like.features.qk_norm = true;
        gemma_like.features.arch = "gemma3";
        let err = gpu_supports(&gemma_like).unwrap_err();
        assert!(err.to_string().contains("Llama family"), "{err}");
        let mut windowed = llama();
        windowed.features.layer_windows = vec![Some(32), None];
        assert!(gpu_supports(&windowed).is_err());
        let mut geglu = llama();
        geglu.features.activation = Activation::GeluTanh;
        assert!(gpu_supports(&geglu).is_err());
    }

    #[test]
    fn a_batch_becomes_rows_with_their_cache_index_and_table() {
        // Sequence 0: a decode token at cache index 20; sequence 1: a 3-token prefill chunk at
        // cache indices 4..7; blocks of 4.
        let tables = [vec![9u32, 3, 5, 1, 2, 7], vec![4u32, 8]];
        let seqs = [
            SeqBatch {
                query_start: 0,
                query_len: 1,
                context_len: 21,
                block_tables: std::slice::from_ref(&tables[0]),
            },
            SeqBatch {
                query_start: 1,
                query_len: 3,
                context_len: 7,
                block_tables: std::slice::from_ref(&tables[1]),
            },
        ];
        let slots = vec![7 * 4, 8 * 4, 8 * 4 + 1, 8 * 4 + 2];
        let batch = ForwardBatch {
            token_ids: &[5, 6, 7, 8],
            positions: &[20, 4, 5, 6],
            slot_mappings: std::slice::from_ref(&slots),
            seqs: &seqs,
            logits_indices: &[0, 3],
        };
        let step = gpu_step(&batch, 4, 256).unwrap();
        let input = step.input();
        assert_eq!(input.ctx_idx, &[20, 4, 5, 6]);
        assert_eq!(input.table_off, &[0, 6, 6, 6]);
        assert_eq!(input.tables, &[9, 3, 5, 1, 2, 7, 4, 8]);
        assert_eq!(input.slots, &[28, 32, 33, 34]);
        assert_eq!(input.logits_rows, &[0, 3]);
        // A slot that disagrees with the table is refused before anything reaches the GPU.
        let bad = vec![7 * 4, 8 * 4, 8 * 4 + 1, 8 * 4 + 3];
        let batch = ForwardBatch {
            slot_mappings: std::slice::from_ref(&bad),
            ..batch
        };
        assert!(gpu_step(&batch, 4, 256).is_err());
    }
}
