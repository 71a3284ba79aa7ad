//! The Llama family (Llama 2/3, SmolLM, TinyLlama, …): RMSNorm, RoPE with the model's theta and
//! scaling, grouped-query attention over the paged KV cache, SwiGLU, optionally tied embeddings.
//!
//! Weights are read through `WeightSource` under llama.cpp's tensor names (`blk.N.attn_q.weight`),
//! whatever the file format, in HF layout. Q, K and V are fused into one matrix, as are gate and
//! up, so a step runs four matmuls per layer over all tokens of the batch.
//!
//! A [`Llama`] is the whole model or one rank's shard of it ([`LlamaWeights::shard`]): with
//! tensor parallelism each rank holds its attention heads, KV heads and MLP slice, and sums the
//! row-parallel projections (attention output, down) over its TP group; with pipeline parallelism
//! each stage holds a contiguous run of layers and hands its hidden states to the next stage. The
//! last stage's ranks hold the output layer split by vocabulary rows and gather the logits.
//!
//! Invariants: storage layer `j` of a shard is model layer `layer_range.start + j` (named
//! `model.layers.{i}.self_attn` with the global `i`); every token's K and V are written to its
//! slot before that layer's attention reads the cache; a token's logits depend only on its own
//! sequence (all ops are row-independent), so continuous batching does not change them; a rank
//! whose forward fails aborts its collectives, so no other rank waits for it.

use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;
use tandem_kv_cache::{CacheDtype, KvCacheGroup, KvCacheSpec, KvStorage};
use tandem_parallel::{Collectives, ParallelConfig, RankId};

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

/// One layer's weights as read from the file, before sharding.
struct RawLayer {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    q: HostMatrix,
    k: HostMatrix,
    v: HostMatrix,
    o: HostMatrix,
    gate: HostMatrix,
    up: HostMatrix,
    down: HostMatrix,
}

/// A Llama-family model's weights as read from the file: what every rank's shard is cut from.
pub(crate) struct LlamaWeights {
    cfg: LlamaConfig,
    layers: Vec<RawLayer>,
    embed: HostMatrix,
    /// `None` when the output layer is tied to the embedding.
    head: Option<HostMatrix>,
    norm: Vec<f32>,
}

impl LlamaWeights {
    /// Reads every tensor of the model and checks its shape against `cfg`.
    pub(crate) fn read(src: &mut dyn WeightSource, cfg: LlamaConfig) -> Result<Self, ModelError> {
        cfg.validate()?;
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
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
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let l = RawLayer {
                attn_norm: src.vector(&n("attn_norm"))?,
                ffn_norm: src.vector(&n("ffn_norm"))?,
                q: src.matrix(&n("attn_q"), Some(cfg.num_heads))?,
                k: src.matrix(&n("attn_k"), Some(cfg.num_kv_heads))?,
                v: src.matrix(&n("attn_v"), None)?,
                o: src.matrix(&n("attn_output"), None)?,
                gate: src.matrix(&n("ffn_gate"), None)?,
                up: src.matrix(&n("ffn_up"), None)?,
                down: src.matrix(&n("ffn_down"), None)?,
            };
            check(&l.q, qd, h, &format!("layer {i} attn_q"))?;
            check(&l.k, kvd, h, &format!("layer {i} attn_k"))?;
            check(&l.v, kvd, h, &format!("layer {i} attn_v"))?;
            check(&l.o, h, qd, &format!("layer {i} attn_output"))?;
            check(&l.gate, inter, h, &format!("layer {i} ffn_gate"))?;
            check(&l.up, inter, h, &format!("layer {i} ffn_up"))?;
            check(&l.down, h, inter, &format!("layer {i} ffn_down"))?;
            layers.push(l);
        }
        let embed = src.matrix("token_embd.weight", None)?;
        check(&embed, cfg.vocab_size, h, "token_embd")?;
        let head = if src.has("output.weight") {
            let m = src.matrix("output.weight", None)?;
            check(&m, cfg.vocab_size, h, "output")?;
            Some(m)
        } else {
            None
        };
        let norm = src.vector("output_norm.weight")?;
        Ok(LlamaWeights {
            cfg,
            layers,
            embed,
            head,
            norm,
        })
    }

    /// The shard of the rank `comm` stands for: its stage's layers, its attention heads and KV
    /// heads (column-parallel Q/K/V, row-parallel output projection), its slice of the MLP
    /// (column-parallel gate/up, row-parallel down), the embedding on the first stage, the final
    /// norm and its rows of the output layer (vocab-parallel) on the last.
    pub(crate) fn shard(
        &self,
        mode: WeightMode,
        comm: Arc<dyn Collectives>,
    ) -> Result<Llama, ModelError> {
        let cfg = &self.cfg;
        let (par, rank) = (comm.config(), comm.rank());
        par.check_model(
            cfg.num_layers,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.intermediate_size,
        )?;
        let hd = cfg.head_dim;
        let heads = par.split(cfg.num_heads, rank.tp_rank, "the number of attention heads")?;
        let kv = par.kv_heads(cfg.num_kv_heads, rank.tp_rank)?;
        let kv_rows = kv.first * hd..(kv.first + kv.count) * hd;
        let q_rows = heads.start * hd..heads.end * hd;
        let inter = par.split(cfg.intermediate_size, rank.tp_rank, "intermediate_size")?;
        let layer_range = par.layers(cfg.num_layers, rank.pp_rank);
        let layers = self.layers[layer_range.clone()]
            .par_iter()
            .map(|r| {
                Ok(Layer {
                    attn_norm: r.attn_norm.clone(),
                    qkv: HostMatrix::concat_rows(&[
                        r.q.slice_rows(q_rows.clone()),
                        r.k.slice_rows(kv_rows.clone()),
                        r.v.slice_rows(kv_rows.clone()),
                    ])?
                    .into_linear(mode)?,
                    o: r.o.slice_cols(q_rows.clone())?.into_linear(mode)?,
                    ffn_norm: r.ffn_norm.clone(),
                    gate_up: HostMatrix::concat_rows(&[
                        r.gate.slice_rows(inter.clone()),
                        r.up.slice_rows(inter.clone()),
                    ])?
                    .into_linear(mode)?,
                    down: r.down.slice_cols(inter.clone())?.into_linear(mode)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let first_stage = rank.pp_rank == 0;
        let last_stage = rank.pp_rank + 1 == par.pp;
        let embed = first_stage
            .then(|| self.embed.clone().into_linear(mode))
            .transpose()?;
        let vocab_rows = par.vocab_rows(cfg.vocab_size, rank.tp_rank);
        let whole_vocab = vocab_rows.len() == cfg.vocab_size;
        let lm_head = if !last_stage {
            None
        } else {
            Some(match (&self.head, &embed) {
                // tied and held whole by this rank already: share the embedding's matrix
                (None, Some(e)) if whole_vocab => e.clone(),
                (None, _) => self
                    .embed
                    .slice_rows(vocab_rows.clone())
                    .into_linear(mode)?,
                (Some(m), _) => m.slice_rows(vocab_rows.clone()).into_linear(mode)?,
            })
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
            + lm_head.as_ref().map_or(0, |m| m.bytes())
            + match (&embed, self.head.is_none() && whole_vocab && last_stage) {
                (Some(e), false) => e.bytes(),
                _ => 0,
            }
            + 4 * self.norm.len();
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
            tie_word_embeddings: self.head.is_none(),
            weight_mode: mode,
            weight_bytes,
        };
        let attn = AttentionParams {
            num_heads: heads.len(),
            num_kv_heads: kv.count,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
        };
        Ok(Llama {
            cfg: cfg.clone(),
            info,
            embed,
            layers,
            layer_range,
            norm: self.norm.clone(),
            lm_head,
            rope,
            attn,
            comm,
        })
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    /// Rows: this rank's Q heads, then its K and V heads (`head_dim` rows each).
    qkv: Linear,
    /// Columns: this rank's Q heads (row-parallel: outputs are summed over TP).
    o: Linear,
    ffn_norm: Vec<f32>,
    /// Rows: this rank's slice of gate, then of up.
    gate_up: Linear,
    /// Columns: this rank's slice of the MLP width (row-parallel).
    down: Linear,
}

/// A Llama-family model on the paged KV cache: the whole model (TP 1, PP 1) or one rank's shard.
pub struct Llama {
    cfg: LlamaConfig,
    info: ModelInfo,
    /// The token embedding table, on the first stage.
    embed: Option<Linear>,
    layers: Vec<Layer>,
    /// The model layers this shard runs (storage layer `j` is model layer `start + j`).
    layer_range: Range<usize>,
    norm: Vec<f32>,
    /// This rank's rows of the output layer, on the last stage.
    lm_head: Option<Linear>,
    rope: RopeTable,
    /// This rank's heads.
    attn: AttentionParams,
    comm: Arc<dyn Collectives>,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("info", &self.info)
            .field("rank", &self.comm.rank())
            .finish()
    }
}

/// The layer name the KV cache (and the checksum) uses for layer `i`.
pub fn layer_name(i: usize) -> String {
    format!("model.layers.{i}.self_attn")
}

impl Llama {
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The step's work; on error the caller aborts the collectives (see `forward`).
    fn run(&self, batch: &ForwardBatch, kv: &KvStorage) -> Result<Vec<f32>, ModelError> {
        let c = &self.cfg;
        if kv.num_layers() < self.layers.len() {
            return Err(ModelError::InvalidBatch(format!(
                "the KV cache has {} layers, this shard {}",
                kv.num_layers(),
                self.layers.len()
            )));
        }
        let block_size = kv.layout(0).block_size;
        batch.validate(block_size, self.rope.max_positions())?;
        let t = batch.num_tokens();
        if t == 0 {
            return Ok(Vec::new());
        }
        let h = c.hidden_size;
        let (qd, kvd) = (
            self.attn.num_heads * c.head_dim,
            self.attn.num_kv_heads * c.head_dim,
        );
        let eps = c.rms_norm_eps;

        let mut x = match &self.embed {
            Some(embed) => embed.rows(batch.token_ids)?,
            None => {
                let x = self.comm.recv_from_prev_stage()?;
                if x.len() != t * h {
                    return Err(ModelError::InvalidBatch(format!(
                        "the previous stage handed over {} values for {t} tokens",
                        x.len()
                    )));
                }
                x
            }
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let hn = rms_norm_to(&x, &layer.attn_norm, eps);
            let qkv = layer.qkv.forward(&hn, t)?;
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
            let mut o = layer.o.forward(&attn, t)?;
            self.comm.all_reduce_sum(&mut o)?;
            add_assign(&mut x, &o);
            let hn = rms_norm_to(&x, &layer.ffn_norm, eps);
            let act = silu_mul(&layer.gate_up.forward(&hn, t)?, self.mlp_width());
            let mut d = layer.down.forward(&act, t)?;
            self.comm.all_reduce_sum(&mut d)?;
            add_assign(&mut x, &d);
        }
        let Some(lm_head) = &self.lm_head else {
            self.comm.send_to_next_stage(x)?;
            return Ok(Vec::new());
        };
        let n = batch.logits_indices.len();
        let mut last = Vec::with_capacity(n * h);
        for &r in batch.logits_indices {
            last.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        rms_norm(&mut last, &self.norm, eps);
        let local = lm_head.forward(&last, n)?;
        if self.comm.config().tp == 1 || n == 0 {
            return Ok(local);
        }
        let parts = self.comm.all_gather(&local)?;
        let mut logits = Vec::with_capacity(n * c.vocab_size);
        for row in 0..n {
            for p in &parts {
                let w = p.len() / n;
                logits.extend_from_slice(&p[row * w..(row + 1) * w]);
            }
        }
        if logits.len() != n * c.vocab_size {
            return Err(ModelError::InvalidBatch(format!(
                "gathered {} logits for {n} rows of {}",
                logits.len(),
                c.vocab_size
            )));
        }
        Ok(logits)
    }

    /// This rank's slice of the MLP width.
    fn mlp_width(&self) -> usize {
        self.cfg.intermediate_size / self.comm.config().tp
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
                num_kv_heads: self.attn.num_kv_heads,
                head_dim: self.cfg.head_dim,
                dtype,
            },
            layer_names: self.layer_range.clone().map(layer_name).collect(),
        }]
    }

    fn forward(&self, batch: &ForwardBatch, kv: &KvStorage) -> Result<Vec<f32>, ModelError> {
        let out = self.run(batch, kv);
        if let Err(e) = &out {
            // the other ranks may wait for this one inside a collective: release them
            self.comm.abort(&e.to_string());
        }
        out
    }

    fn parallel_rank(&self) -> (ParallelConfig, RankId) {
        (self.comm.config(), self.comm.rank())
    }
}
