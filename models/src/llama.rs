//! The Llama family (Llama 2/3, SmolLM, TinyLlama, …): RMSNorm, RoPE with the model's theta and
//! scaling, grouped-query attention over the paged KV cache, SwiGLU, optionally tied embeddings.
//!
//! Weights are read through `WeightSource` under llama.cpp's tensor names (`blk.N.attn_q.weight`),
//! whatever the file format, in HF layout. Q, K and V are fused into one matrix, as are gate and
//! up, so a step runs four matmuls per layer over all tokens of the batch.
//!
//! Invariants: storage layer `i` is model layer `i` (named `model.layers.{i}.self_attn`); every
//! token's K and V are written to its slot before that layer's attention reads the cache; a
//! token's logits depend only on its own sequence (all ops are row-independent), so continuous
//! batching does not change them.

use rayon::prelude::*;
use tandem_kv_cache::{CacheDtype, KvCacheGroup, KvCacheSpec, KvStorage};

use crate::attention::{paged_attention, AttentionParams, LayerCache};
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::model::{CausalLm, ForwardBatch, ModelInfo};
use crate::ops::{add_assign, rms_norm, rms_norm_to, silu_mul, RopeScaling, RopeTable};
use crate::weights::{HostMatrix, Linear, WeightMode};

/// Where weights come from: a GGUF file or a Hugging Face safetensors directory, addressed by
/// llama.cpp's tensor names.
pub(crate) trait WeightSource {
    fn has(&self, name: &str) -> bool;
    fn vector(&mut self, name: &str) -> Result<Vec<f32>, ModelError>;
    /// A `[out, in]` matrix in HF layout. `qk_heads` is set for Q and K projections: a GGUF
    /// source undoes llama.cpp's row permutation for that many heads.
    fn matrix(&mut self, name: &str, qk_heads: Option<usize>) -> Result<HostMatrix, ModelError>;
}

impl WeightSource for GgufFile {
    fn has(&self, name: &str) -> bool {
        self.has_tensor(name)
    }
    fn vector(&mut self, name: &str) -> Result<Vec<f32>, ModelError> {
        GgufFile::vector(self, name)
    }
    fn matrix(&mut self, name: &str, qk_heads: Option<usize>) -> Result<HostMatrix, ModelError> {
        GgufFile::matrix(self, name, qk_heads)
    }
}

/// Hyper-parameters of a Llama-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
}

impl LlamaConfig {
    /// From GGUF metadata (`{arch}.*` keys) and the presence of tensors.
    pub fn from_gguf(g: &mut GgufFile) -> Result<Self, ModelError> {
        let arch = g.str("general.architecture")?.to_owned();
        if arch != "llama" {
            return Err(ModelError::Unsupported(format!(
                "GGUF architecture `{arch}` (supported: llama)"
            )));
        }
        let k = |s: &str| format!("{arch}.{s}");
        let hidden_size = g.usize(&k("embedding_length"))?;
        let num_heads = g.usize(&k("attention.head_count"))?;
        let num_kv_heads = g
            .opt_usize(&k("attention.head_count_kv"))
            .unwrap_or(num_heads);
        let head_dim = g
            .opt_usize(&k("attention.key_length"))
            .unwrap_or(hidden_size / num_heads.max(1));
        let rotary_dim = g.opt_usize(&k("rope.dimension_count")).unwrap_or(head_dim);
        if rotary_dim != head_dim {
            return Err(ModelError::Unsupported(format!(
                "partial rotary embeddings ({rotary_dim} of {head_dim} dimensions)"
            )));
        }
        let vocab_size = match g.opt_usize(&k("vocab_size")) {
            Some(v) => v,
            None => g.str_array("tokenizer.ggml.tokens")?.len(),
        };
        let rope_scaling = if g.has_tensor("rope_freqs.weight") {
            Some(RopeScaling::FreqFactors(g.vector("rope_freqs.weight")?))
        } else {
            match g.opt_str(&k("rope.scaling.type")) {
                None | Some("none") => None,
                Some("linear") => Some(RopeScaling::Linear {
                    factor: g.opt_f32(&k("rope.scaling.factor")).unwrap_or(1.0),
                }),
                Some(other) => {
                    return Err(ModelError::Unsupported(format!("RoPE scaling `{other}`")))
                }
            }
        };
        Ok(LlamaConfig {
            hidden_size,
            intermediate_size: g.usize(&k("feed_forward_length"))?,
            num_layers: g.usize(&k("block_count"))?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            max_position_embeddings: g.opt_usize(&k("context_length")).unwrap_or(4096),
            rope_theta: g.opt_f32(&k("rope.freq_base")).unwrap_or(10000.0),
            rope_scaling,
            rms_norm_eps: g
                .opt_f32(&k("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5),
            tie_word_embeddings: !g.has_tensor("output.weight"),
        })
    }

    /// From a Hugging Face `config.json` (`model_type: llama`).
    pub fn from_hf_json(cfg: &serde_json::Value) -> Result<Self, ModelError> {
        let model_type = cfg["model_type"].as_str().unwrap_or("");
        if model_type != "llama" {
            return Err(ModelError::Unsupported(format!(
                "model_type `{model_type}` (supported: llama)"
            )));
        }
        let int = |key: &str| -> Result<usize, ModelError> {
            cfg[key]
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| ModelError::format(format!("config.json: `{key}` is missing")))
        };
        let hidden_size = int("hidden_size")?;
        let num_heads = int("num_attention_heads")?;
        let num_kv_heads = int("num_key_value_heads").unwrap_or(num_heads);
        let head_dim = int("head_dim").unwrap_or(hidden_size / num_heads.max(1));
        // transformers 5 nests RoPE settings in `rope_parameters`; older configs keep them flat
        let rope = cfg
            .get("rope_parameters")
            .filter(|v| v.is_object())
            .or_else(|| cfg.get("rope_scaling").filter(|v| v.is_object()));
        let rope_theta = cfg["rope_theta"]
            .as_f64()
            .or_else(|| rope.and_then(|r| r["rope_theta"].as_f64()))
            .unwrap_or(10000.0) as f32;
        let rope_scaling = match rope {
            None => None,
            Some(r) => {
                let ty = r["rope_type"]
                    .as_str()
                    .or(r["type"].as_str())
                    .unwrap_or("default");
                let f = |key: &str| r[key].as_f64().map(|x| x as f32);
                match ty {
                    "default" => None,
                    "linear" => Some(RopeScaling::Linear {
                        factor: f("factor").unwrap_or(1.0),
                    }),
                    "llama3" => Some(RopeScaling::Llama3 {
                        factor: f("factor").unwrap_or(8.0),
                        low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
                        high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
                        original_max_position_embeddings: r["original_max_position_embeddings"]
                            .as_u64()
                            .unwrap_or(8192)
                            as usize,
                    }),
                    other => {
                        return Err(ModelError::Unsupported(format!("RoPE scaling `{other}`")))
                    }
                }
            }
        };
        Ok(LlamaConfig {
            hidden_size,
            intermediate_size: int("intermediate_size")?,
            num_layers: int("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: int("vocab_size")?,
            max_position_embeddings: int("max_position_embeddings").unwrap_or(4096),
            rope_theta,
            rope_scaling,
            rms_norm_eps: cfg["rms_norm_eps"].as_f64().unwrap_or(1e-5) as f32,
            tie_word_embeddings: cfg["tie_word_embeddings"].as_bool().unwrap_or(false),
        })
    }

    fn validate(&self) -> Result<(), ModelError> {
        let ok = self.num_heads > 0
            && self.num_kv_heads > 0
            && self.num_heads.is_multiple_of(self.num_kv_heads)
            && self.head_dim > 0
            && self.head_dim.is_multiple_of(2)
            && self.num_layers > 0
            && self.vocab_size > 0;
        if ok {
            Ok(())
        } else {
            Err(ModelError::format(format!(
                "inconsistent Llama config: {self:?}"
            )))
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    /// Rows: Q (`num_heads * head_dim`), K, V (`num_kv_heads * head_dim` each).
    qkv: Linear,
    o: Linear,
    ffn_norm: Vec<f32>,
    /// Rows: gate, up (`intermediate_size` each).
    gate_up: Linear,
    down: Linear,
}

/// A Llama-family model on the paged KV cache.
pub struct Llama {
    cfg: LlamaConfig,
    info: ModelInfo,
    /// The token embedding table (shared with `lm_head` when tied).
    embed: Linear,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    rope: RopeTable,
    attn: AttentionParams,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama").field("info", &self.info).finish()
    }
}

/// The layer name the KV cache (and the checksum) uses for layer `i`.
pub fn layer_name(i: usize) -> String {
    format!("model.layers.{i}.self_attn")
}

impl Llama {
    pub(crate) fn load(
        src: &mut dyn WeightSource,
        cfg: LlamaConfig,
        mode: WeightMode,
    ) -> Result<Self, ModelError> {
        cfg.validate()?;
        // Read everything first (sequential I/O), then convert the matrices in parallel.
        struct Raw {
            attn_norm: Vec<f32>,
            ffn_norm: Vec<f32>,
            qkv: HostMatrix,
            o: HostMatrix,
            gate_up: HostMatrix,
            down: HostMatrix,
        }
        let mut raw = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let q = src.matrix(&n("attn_q"), Some(cfg.num_heads))?;
            let k = src.matrix(&n("attn_k"), Some(cfg.num_kv_heads))?;
            let v = src.matrix(&n("attn_v"), None)?;
            let gate = src.matrix(&n("ffn_gate"), None)?;
            let up = src.matrix(&n("ffn_up"), None)?;
            raw.push(Raw {
                attn_norm: src.vector(&n("attn_norm"))?,
                ffn_norm: src.vector(&n("ffn_norm"))?,
                qkv: HostMatrix::concat_rows(&[q, k, v])?,
                o: src.matrix(&n("attn_output"), None)?,
                gate_up: HostMatrix::concat_rows(&[gate, up])?,
                down: src.matrix(&n("ffn_down"), None)?,
            });
        }
        let embed_m = src.matrix("token_embd.weight", None)?;
        let head_m = if src.has("output.weight") {
            Some(src.matrix("output.weight", None)?)
        } else {
            None
        };
        let norm = src.vector("output_norm.weight")?;

        let (qd, kvd) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        let check = |m: &HostMatrix, rows: usize, cols: usize, what: &str| {
            if m.rows == rows && m.cols == cols {
                Ok(())
            } else {
                Err(ModelError::format(format!(
                    "{what} is [{}, {}], expected [{rows}, {cols}]",
                    m.rows, m.cols
                )))
            }
        };
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        for (i, r) in raw.iter().enumerate() {
            check(&r.qkv, qd + 2 * kvd, h, &format!("layer {i} qkv"))?;
            check(&r.o, h, qd, &format!("layer {i} attn_output"))?;
            check(&r.gate_up, 2 * inter, h, &format!("layer {i} gate/up"))?;
            check(&r.down, h, inter, &format!("layer {i} ffn_down"))?;
        }
        check(&embed_m, cfg.vocab_size, h, "token_embd")?;

        let layers = raw
            .into_par_iter()
            .map(|r| {
                Ok(Layer {
                    attn_norm: r.attn_norm,
                    qkv: r.qkv.into_linear(mode)?,
                    o: r.o.into_linear(mode)?,
                    ffn_norm: r.ffn_norm,
                    gate_up: r.gate_up.into_linear(mode)?,
                    down: r.down.into_linear(mode)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let embed = embed_m.into_linear(mode)?;
        let (lm_head, tied) = match head_m {
            Some(m) => {
                check(&m, cfg.vocab_size, h, "output")?;
                (m.into_linear(mode)?, false)
            }
            None => (embed.clone(), true),
        };
        let rope = RopeTable::new(
            cfg.rope_theta,
            cfg.head_dim,
            cfg.max_position_embeddings,
            cfg.rope_scaling.as_ref(),
        )?;
        let weight_bytes = layers
            .iter()
            .map(|l| {
                l.qkv.bytes()
                    + l.o.bytes()
                    + l.gate_up.bytes()
                    + l.down.bytes()
                    + 4 * (l.attn_norm.len() + l.ffn_norm.len())
            })
            .sum::<usize>()
            + lm_head.bytes()
            + if tied { 0 } else { embed.bytes() }
            + 4 * norm.len();
        let info = ModelInfo {
            architecture: "llama".into(),
            num_layers: cfg.num_layers,
            hidden_size: cfg.hidden_size,
            intermediate_size: cfg.intermediate_size,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            vocab_size: cfg.vocab_size,
            max_position_embeddings: cfg.max_position_embeddings,
            rope_theta: cfg.rope_theta,
            rms_norm_eps: cfg.rms_norm_eps,
            tie_word_embeddings: tied,
            weight_mode: mode,
            weight_bytes,
        };
        let attn = AttentionParams {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            window: None,
        };
        Ok(Llama {
            cfg,
            info,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            attn,
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }
}

impl CausalLm for Llama {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn kv_cache_groups(&self, block_size: usize, dtype: CacheDtype) -> Vec<KvCacheGroup> {
        vec![KvCacheGroup {
            group_id: 0,
            spec: KvCacheSpec::FullAttention {
                block_size,
                num_kv_heads: self.cfg.num_kv_heads,
                head_dim: self.cfg.head_dim,
                dtype,
            },
            layer_names: (0..self.cfg.num_layers).map(layer_name).collect(),
        }]
    }

    fn forward(&self, batch: &ForwardBatch, kv: &KvStorage) -> Result<Vec<f32>, ModelError> {
        let c = &self.cfg;
        if kv.num_layers() < c.num_layers {
            return Err(ModelError::InvalidBatch(format!(
                "the KV cache has {} layers, the model {}",
                kv.num_layers(),
                c.num_layers
            )));
        }
        let block_size = kv.layout(0).block_size;
        batch.validate(block_size, self.rope.max_positions())?;
        let t = batch.num_tokens();
        if t == 0 {
            return Ok(Vec::new());
        }
        let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let eps = c.rms_norm_eps;

        let mut x = self.embed.rows(batch.token_ids)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm_to(&x, &layer.attn_norm, eps);
            let qkv = layer.qkv.forward(&h, t)?;
            let mut q = Vec::with_capacity(t * qd);
            let mut k = Vec::with_capacity(t * kvd);
            let mut v = Vec::with_capacity(t * kvd);
            for row in qkv.chunks_exact(qd + 2 * kvd) {
                q.extend_from_slice(&row[..qd]);
                k.extend_from_slice(&row[qd..qd + kvd]);
                v.extend_from_slice(&row[qd + kvd..]);
            }
            self.rope.apply(&mut q, batch.positions, c.head_dim);
            self.rope.apply(&mut k, batch.positions, c.head_dim);
            kv.write_slots(l, batch.slot_mapping, &k, &v)?;
            let attn =
                paged_attention(&q, batch.seqs, LayerCache::from_storage(kv, l)?, &self.attn)?;
            add_assign(&mut x, &layer.o.forward(&attn, t)?);
            let h = rms_norm_to(&x, &layer.ffn_norm, eps);
            let act = silu_mul(&layer.gate_up.forward(&h, t)?, c.intermediate_size);
            add_assign(&mut x, &layer.down.forward(&act, t)?);
        }
        let n = batch.logits_indices.len();
        let mut last = Vec::with_capacity(n * c.hidden_size);
        for &r in batch.logits_indices {
            last.extend_from_slice(&x[r * c.hidden_size..(r + 1) * c.hidden_size]);
        }
        rms_norm(&mut last, &self.norm, eps);
        self.lm_head.forward(&last, n)
    }
}
