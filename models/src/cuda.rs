//! The GPU decoder of `tandem-kernels` ([`GpuDecoder`]: bf16 weights, a paged bf16 KV cache in
//! device memory) loaded from the files the CPU decoder reads, and the engine's [`ForwardBatch`]
//! translated into its step arrays ([`gpu_step`]).
//!
//! Invariants: only models the GPU decoder computes exactly as the CPU one are loaded (the Llama
//! family: SwiGLU, one full-attention cache, no extra norms or scales); others are refused with
//! [`ModelError::Unsupported`]. A batch is validated ([`ForwardBatch::validate`]) before it is
//! translated.

use std::path::PathBuf;

use tandem_kernels::cuda::{
    DecoderShape, Device, DeviceKvCache, GpuDecoder, KvArrangement, OwnedStep, Weights,
};
use tandem_kv_cache::{BlockLayout, CacheDtype};

use tandem_kv_cache::{KvCacheGroup, KvCacheSpec, KvStorage};

use crate::decoder::{layer_name, Activation, DecoderConfig, DecoderWeights};
use crate::error::ModelError;
use crate::loader::{read_weights, LoadOptions};
use crate::model::{CausalLm, ForwardBatch, ModelInfo};
use crate::ops::RopeTable;
use crate::tokenizer::TextTokenizer;
use crate::weights::WeightMode;

/// A model read on the host and checked for the GPU decoder, not yet on a GPU: the engine sizes
/// its KV cache from [`GpuModelFiles::info`] and [`GpuModelFiles::kv_cache_groups`] first.
pub struct GpuModelFiles {
    pub name: String,
    pub path: PathBuf,
    info: ModelInfo,
    weights: DecoderWeights,
}

/// Resolves and reads `spec` as [`crate::load_model`] does, for the GPU decoder: the model and its
/// tokenizer.
pub fn read_gpu_model(
    spec: &str,
    opts: &LoadOptions,
) -> Result<(GpuModelFiles, TextTokenizer), ModelError> {
    if opts.weights.is_some_and(|w| w != WeightMode::Bf16) {
        return Err(ModelError::Unsupported(format!(
            "the GPU decoder holds weights in bf16, not {}",
            opts.weights.map_or("", WeightMode::name)
        )));
    }
    if !opts.parallel.is_single() {
        return Err(ModelError::Unsupported(
            "the GPU decoder runs one whole model (tensor and pipeline parallel size 1)".into(),
        ));
    }
    let (name, path, weights, tokenizer) = read_weights(spec, opts)?;
    let cfg = weights.config().clone();
    check_supported(&cfg)?;
    let shape = shape_of(&cfg);
    let info = weights.model_info(WeightMode::Bf16, shape.weight_bytes());
    Ok((
        GpuModelFiles {
            name,
            path,
            info,
            weights,
        },
        tokenizer,
    ))
}

impl GpuModelFiles {
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The one full-attention group of the model's layers, as the CPU decoder names them.
    pub fn kv_cache_groups(&self, block_size: usize, dtype: CacheDtype) -> Vec<KvCacheGroup> {
        full_attention_group(&self.info, block_size, dtype)
    }

    /// Places the model and a KV cache of `cache` on `device`.
    pub fn upload(self, device: &Device, cache: GpuCacheOptions) -> Result<GpuModel, ModelError> {
        let cfg = self.weights.config().clone();
        let inv_freq =
            RopeTable::inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling.as_ref())?;
        let layout = BlockLayout::token_major(
            cache.num_blocks,
            cache.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            CacheDtype::Bf16,
        );
        let kv = DeviceKvCache::new(device, layout, cfg.num_layers, cache.arrangement)?;
        let weights = &self.weights;
        let mut failure = None;
        let mut source = |t| {
            weights.gpu_tensor(t).map_err(|e| {
                let msg = e.to_string();
                failure = Some(e);
                msg
            })
        };
        let decoder = GpuDecoder::new(
            device,
            shape_of(&cfg),
            &inv_freq,
            kv,
            cache.max_tokens,
            Weights::Host(&mut source),
        );
        let decoder = match (decoder, failure) {
            (Ok(d), _) => d,
            (Err(_), Some(e)) => return Err(e),
            (Err(e), None) => return Err(e.into()),
        };
        Ok(GpuModel {
            name: self.name,
            path: self.path,
            config: cfg,
            info: self.info,
            decoder,
        })
    }
}

/// The one KV cache group of a model the GPU decoder runs: every layer full attention, named as
/// the CPU decoder names them.
fn full_attention_group(
    info: &ModelInfo,
    block_size: usize,
    dtype: CacheDtype,
) -> Vec<KvCacheGroup> {
    vec![KvCacheGroup {
        group_id: 0,
        spec: KvCacheSpec::FullAttention {
            block_size,
            num_kv_heads: info.num_kv_heads,
            head_dim: info.head_dim,
            dtype,
        },
        layer_names: (0..info.num_layers).map(layer_name).collect(),
    }]
}

fn shape_of(cfg: &DecoderConfig) -> DecoderShape {
    DecoderShape {
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        layers: cfg.num_layers,
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        vocab: cfg.vocab_size,
        max_positions: cfg.max_position_embeddings,
        rms_eps: cfg.rms_norm_eps,
        tie_embeddings: false,
    }
}

/// A model loaded on a GPU.
pub struct GpuModel {
    pub name: String,
    pub path: PathBuf,
    pub config: DecoderConfig,
    pub info: ModelInfo,
    pub decoder: GpuDecoder,
}

/// The device KV cache a [`GpuModel`] gets.
#[derive(Debug, Clone, Copy)]
pub struct GpuCacheOptions {
    pub num_blocks: usize,
    pub block_size: usize,
    pub arrangement: KvArrangement,
    /// Rows a step may have (the engine's step budget).
    pub max_tokens: usize,
}

/// Loads `spec` (resolved as [`crate::load_model`] does) onto `device` in bf16.
pub fn load_gpu_model(
    spec: &str,
    opts: &LoadOptions,
    device: &Device,
    cache: GpuCacheOptions,
) -> Result<GpuModel, ModelError> {
    read_gpu_model(spec, opts)?.0.upload(device, cache)
}

/// Refuses what the GPU decoder does not compute (everything but the Llama family).
fn check_supported(cfg: &DecoderConfig) -> Result<(), ModelError> {
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

/// The engine's view of a [`GpuModel`]: the KV cache it is handed describes the device cache
/// ([`KvStorage::elsewhere`], checked against it every step); the model reads and writes the
/// device cache itself.
impl CausalLm for GpuModel {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn kv_cache_groups(&self, block_size: usize, dtype: CacheDtype) -> Vec<KvCacheGroup> {
        full_attention_group(&self.info, block_size, dtype)
    }

    fn forward(&self, batch: &ForwardBatch, kv: &KvStorage) -> Result<Vec<f32>, ModelError> {
        let device = self.decoder.cache().layout();
        let matches = !kv.in_host_memory()
            && kv.num_layers() == self.info.num_layers
            && (0..kv.num_layers()).all(|l| {
                let h = kv.layout(l);
                h.num_blocks == device.num_blocks
                    && h.block_size == device.block_size
                    && h.dtype == device.dtype
            });
        if !matches {
            return Err(ModelError::InvalidBatch(format!(
                "the engine's KV storage ({} layers, host memory: {}) does not describe this \
                 GPU model's device cache ({} layers of {} blocks of {} bf16 tokens)",
                kv.num_layers(),
                kv.in_host_memory(),
                self.info.num_layers,
                device.num_blocks,
                device.block_size
            )));
        }
        GpuModel::forward(self, batch)
    }
}

impl GpuModel {
    /// Runs one step of the engine's batch and returns the logits of its `logits_indices` rows.
    pub fn forward(&self, batch: &ForwardBatch<'_>) -> Result<Vec<f32>, ModelError> {
        let block_size = self.decoder.cache().layout().block_size;
        let step = gpu_step(batch, block_size, self.config.max_position_embeddings)?;
        Ok(self.decoder.forward(&step.input())?)
    }
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
        assert!(check_supported(&llama()).is_ok());
        let mut gemma_like = llama();
        gemma_like.features.qk_norm = true;
        gemma_like.features.arch = "gemma3";
        let err = check_supported(&gemma_like).unwrap_err();
        assert!(err.to_string().contains("Llama family"), "{err}");
        let mut windowed = llama();
        windowed.features.layer_windows = vec![Some(32), None];
        assert!(check_supported(&windowed).is_err());
        let mut geglu = llama();
        geglu.features.activation = Activation::GeluTanh;
        assert!(check_supported(&geglu).is_err());
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
