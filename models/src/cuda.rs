//! The GPU decoder of `tandem-kernels` ([`GpuDecoder`]: bf16 weights, a paged bf16 KV cache in
//! device memory) loaded from the files the CPU decoder reads, and run on the engine's
//! [`ForwardBatch`] as `crate::gpu_batch` translates it.
//!
//! Invariants: only models the GPU decoder computes exactly as the CPU one are loaded (the Llama
//! family: SwiGLU, one full-attention cache, no extra norms or scales); others are refused with
//! [`ModelError::Unsupported`]. A batch is validated ([`ForwardBatch::validate`]) before it is
//! translated.

use std::path::PathBuf;

use tandem_kernels::cuda::{
    DecoderShape, Device, DeviceKvCache, GpuDecoder, KvArrangement, Weights,
};
use tandem_kv_cache::{BlockLayout, CacheDtype};

use tandem_kv_cache::{KvCacheGroup, KvCacheSpec, KvStorage};

use crate::decoder::{layer_name, DecoderConfig, DecoderWeights};
use crate::error::ModelError;
use crate::gpu_batch::{gpu_step, gpu_supports};
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
    gpu_supports(&cfg)?;
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
