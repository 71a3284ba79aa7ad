//! The decoder-only transformer that Tandem's architectures share, over the paged KV cache:
//! RMSNorm, RoPE, grouped-query attention, a gated MLP, optionally tied embeddings. What differs
//! between architectures is data ([`Features`]): Llama ([`crate::llama`]) uses SwiGLU and one
//! full-attention cache; Gemma 3 ([`crate::gemma3`]) adds query and key norms, norms after
//! attention and MLP, a scaled embedding, GeGLU, and interleaves sliding-window layers (their own
//! RoPE base, their own KV cache group) with full-attention ones.
//!
//! Weights are read through `WeightSource` under llama.cpp's tensor names (`blk.N.attn_q.weight`),
//! whatever the file format, in HF layout. Q, K and V are fused into one matrix, as are gate and
//! up, so a step runs four matmuls per layer over all tokens of the batch.
//!
//! A [`Decoder`] is the whole model or one rank's shard of it ([`DecoderWeights::shard`]): with
//! tensor parallelism each rank holds its attention heads, KV heads and MLP slice, and sums the
//! row-parallel projections (attention output, down) over its TP group; with pipeline parallelism
//! each stage holds a contiguous run of layers and hands its hidden states to the next stage. The
//! last stage's ranks hold the output layer split by vocabulary rows and gather the logits.
//!
//! Invariants: the shard's KV cache groups list its layers group by group (full attention first,
//! then sliding window), each named `model.layers.{i}.self_attn` with the global `i`, and
//! `storage_layer[j]` is where the shard's `j`-th layer lives in that order; every token's K and V are written to its
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
use crate::ops::{
    add_assign, gelu_tanh_mul, rms_norm, rms_norm_to, silu_mul, RopeScaling, RopeTable,
};
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

/// The gated MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` (SwiGLU: Llama).
    Silu,
    /// `gelu_tanh(gate) * up` (GeGLU: Gemma).
    GeluTanh,
}

/// What an architecture changes in the shared decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    /// The architecture's name (`llama`, `gemma3`).
    pub arch: &'static str,
    /// Sliding window of each layer, in tokens a query sees (itself included); `None` is full
    /// attention. Empty: every layer is full attention.
    pub layer_windows: Vec<Option<usize>>,
    /// RoPE base of the sliding-window layers (`None`: the model's `rope_theta`).
    pub rope_theta_sliding: Option<f32>,
    /// Multiplier of `q·k` (`None`: `1/sqrt(head_dim)`).
    pub attn_scale: Option<f32>,
    /// Multiplier of the token embedding (Gemma: `sqrt(hidden_size)`).
    pub embed_scale: Option<f32>,
    /// RMSNorm over each head of Q and K before RoPE (`attn_q_norm`, `attn_k_norm`).
    pub qk_norm: bool,
    /// RMSNorm of the attention and MLP outputs before the residual adds (`post_attention_norm`,
    /// `post_ffw_norm`).
    pub post_norms: bool,
    pub activation: Activation,
    /// Whether a GGUF stores Q and K rows in llama.cpp's permuted order (the Llama family).
    pub gguf_permuted_qk: bool,
}

impl Features {
    pub fn llama() -> Self {
        Features {
            arch: "llama",
            layer_windows: Vec::new(),
            rope_theta_sliding: None,
            attn_scale: None,
            embed_scale: None,
            qk_norm: false,
            post_norms: false,
            activation: Activation::Silu,
            gguf_permuted_qk: true,
        }
    }

    /// The window of layer `i`.
    pub fn window(&self, i: usize) -> Option<usize> {
        self.layer_windows.get(i).copied().flatten()
    }

    /// The KV cache group of layer `i` of a model of `num_layers` layers, the same on every
    /// rank: 0 for full attention, and for sliding-window layers 1 when the model has
    /// full-attention layers too, else 0.
    pub fn kv_group(&self, i: usize, num_layers: usize) -> usize {
        let any_full = (0..num_layers).any(|j| self.window(j).is_none());
        usize::from(self.window(i).is_some() && any_full)
    }
}

/// Hyper-parameters of a model of the shared decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderConfig {
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
    pub features: Features,
}

impl DecoderConfig {
    /// From a GGUF of a supported architecture (`general.architecture`: `llama`, `gemma3`).
    pub fn from_gguf(g: &mut GgufFile) -> Result<Self, ModelError> {
        match g.str("general.architecture")? {
            "gemma3" => Self::from_gemma3_gguf(g),
            _ => Self::from_llama_gguf(g),
        }
    }

    fn validate(&self) -> Result<(), ModelError> {
        let ok = self.num_heads > 0
            && self.num_kv_heads > 0
            && self.num_heads.is_multiple_of(self.num_kv_heads)
            && self.head_dim > 0
            && self.head_dim.is_multiple_of(2)
            && self.num_layers > 0
            && self.vocab_size > 0
            && (self.features.layer_windows.is_empty()
                || self.features.layer_windows.len() == self.num_layers);
        if ok {
            Ok(())
        } else {
            Err(ModelError::format(format!(
                "inconsistent {} config: {self:?}",
                self.features.arch
            )))
        }
    }
}

/// One layer's RMSNorm weights (never sharded: every rank holds them whole).
#[derive(Clone)]
struct LayerNorms {
    /// Before attention (`attn_norm`) and before the MLP (`ffn_norm`).
    attn: Vec<f32>,
    ffn: Vec<f32>,
    /// Per-head norms of Q and K (`Features::qk_norm`).
    q: Option<Vec<f32>>,
    k: Option<Vec<f32>>,
    /// Of the attention and MLP outputs (`Features::post_norms`).
    post_attn: Option<Vec<f32>>,
    post_ffn: Option<Vec<f32>>,
}

impl LayerNorms {
    fn len(&self) -> usize {
        [&self.q, &self.k, &self.post_attn, &self.post_ffn]
            .iter()
            .map(|n| n.as_ref().map_or(0, Vec::len))
            .sum::<usize>()
            + self.attn.len()
            + self.ffn.len()
    }
}

/// One layer's weights as read from the file, before sharding.
struct RawLayer {
    norms: LayerNorms,
    q: HostMatrix,
    k: HostMatrix,
    v: HostMatrix,
    o: HostMatrix,
    gate: HostMatrix,
    up: HostMatrix,
    down: HostMatrix,
}

/// A model's weights as read from the file: what every rank's shard is cut from.
pub(crate) struct DecoderWeights {
    cfg: DecoderConfig,
    layers: Vec<RawLayer>,
    embed: HostMatrix,
    /// `None` when the output layer is tied to the embedding.
    head: Option<HostMatrix>,
    norm: Vec<f32>,
}

impl DecoderWeights {
    /// The whole model's [`ModelInfo`], its weights held as `mode`, `weight_bytes` of them read
    /// per step (by the rank this is for).
    pub(crate) fn model_info(&self, mode: WeightMode, weight_bytes: usize) -> ModelInfo {
        let cfg = &self.cfg;
        ModelInfo {
            architecture: cfg.features.arch.into(),
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
        }
    }

    /// Whether every layer matrix is stored as Q4_1 (see [`WeightMode::auto_for`]).
    pub(crate) fn layers_q4_1(&self) -> bool {
        self.layers.iter().all(|l| {
            [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]
                .iter()
                .all(|m| m.is_q4_1())
        })
    }

    /// Reads every tensor of the model and checks its shape against `cfg`.
    pub(crate) fn read(src: &mut dyn WeightSource, cfg: DecoderConfig) -> Result<Self, ModelError> {
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
        let f = &cfg.features;
        let permuted = |heads: usize| f.gguf_permuted_qk.then_some(heads);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let mut vector_of =
                |name: &str, len: usize, on: bool| -> Result<Option<Vec<f32>>, ModelError> {
                    if !on {
                        return Ok(None);
                    }
                    let v = src.vector(&n(name))?;
                    if v.len() != len {
                        return Err(ModelError::format(format!(
                            "layer {i} {name} has {} values, expected {len}",
                            v.len()
                        )));
                    }
                    Ok(Some(v))
                };
            let norms = LayerNorms {
                q: vector_of("attn_q_norm", cfg.head_dim, f.qk_norm)?,
                k: vector_of("attn_k_norm", cfg.head_dim, f.qk_norm)?,
                post_attn: vector_of("post_attention_norm", h, f.post_norms)?,
                post_ffn: vector_of("post_ffw_norm", h, f.post_norms)?,
                attn: src.vector(&n("attn_norm"))?,
                ffn: src.vector(&n("ffn_norm"))?,
            };
            let l = RawLayer {
                norms,
                q: src.matrix(&n("attn_q"), permuted(cfg.num_heads))?,
                k: src.matrix(&n("attn_k"), permuted(cfg.num_kv_heads))?,
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
        Ok(DecoderWeights {
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
    ) -> Result<Decoder, ModelError> {
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
                    norms: r.norms.clone(),
                    qkv: HostMatrix::concat_rows(&[
                        r.q.slice_rows(q_rows.clone()),
                        r.k.slice_rows(kv_rows.clone()),
                        r.v.slice_rows(kv_rows.clone()),
                    ])?
                    .into_linear(mode)?,
                    o: r.o.slice_cols(q_rows.clone())?.into_linear(mode)?,
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
        let rope = |theta: f32| {
            RopeTable::new(
                theta,
                cfg.head_dim,
                cfg.max_position_embeddings,
                cfg.rope_scaling.as_ref(),
            )
        };
        let rope_full = rope(cfg.rope_theta)?;
        let rope_sliding = cfg.features.rope_theta_sliding.map(rope).transpose()?;
        let weight_bytes = layers
            .iter()
            .map(|l| {
                l.qkv.bytes() + l.o.bytes() + l.gate_up.bytes() + l.down.bytes() + 4 * l.norms.len()
            })
            .sum::<usize>()
            + lm_head.as_ref().map_or(0, |m| m.bytes())
            + match (&embed, self.head.is_none() && whole_vocab && last_stage) {
                (Some(e), false) => e.bytes(),
                _ => 0,
            }
            + 4 * self.norm.len();
        let info = self.model_info(mode, weight_bytes);
        let scale = cfg.features.attn_scale.unwrap_or(1.0 / (hd as f32).sqrt());
        let attn: Vec<AttentionParams> = layer_range
            .clone()
            .map(|i| AttentionParams {
                num_heads: heads.len(),
                num_kv_heads: kv.count,
                head_dim: hd,
                scale,
                window: cfg.features.window(i),
                kv_group: cfg.features.kv_group(i, cfg.num_layers),
            })
            .collect();
        // Storage order: the full-attention group's layers, then the sliding-window group's.
        let full: Vec<usize> = (0..layers.len())
            .filter(|&j| attn[j].window.is_none())
            .collect();
        let sliding: Vec<usize> = (0..layers.len())
            .filter(|&j| attn[j].window.is_some())
            .collect();
        let mut storage_layer = vec![0; layers.len()];
        for (slot, &j) in full.iter().chain(&sliding).enumerate() {
            storage_layer[j] = slot;
        }
        Ok(Decoder {
            cfg: cfg.clone(),
            info,
            embed,
            layers,
            layer_range,
            storage_layer,
            norm: self.norm.clone(),
            lm_head,
            rope_full,
            rope_sliding,
            attn,
            local_kv_heads: kv.count,
            comm,
        })
    }
}

struct Layer {
    norms: LayerNorms,
    /// Rows: this rank's Q heads, then its K and V heads (`head_dim` rows each).
    qkv: Linear,
    /// Columns: this rank's Q heads (row-parallel: outputs are summed over TP).
    o: Linear,
    /// Rows: this rank's slice of gate, then of up.
    gate_up: Linear,
    /// Columns: this rank's slice of the MLP width (row-parallel).
    down: Linear,
}

/// A model of the shared decoder on the paged KV cache: the whole model (TP 1, PP 1) or one
/// rank's shard.
pub struct Decoder {
    cfg: DecoderConfig,
    info: ModelInfo,
    /// The token embedding table, on the first stage.
    embed: Option<Linear>,
    layers: Vec<Layer>,
    /// The model layers this shard runs.
    layer_range: Range<usize>,
    /// Storage layer of each of the shard's layers (groups in order: see the module docs).
    storage_layer: Vec<usize>,
    norm: Vec<f32>,
    /// This rank's rows of the output layer, on the last stage.
    lm_head: Option<Linear>,
    rope_full: RopeTable,
    /// RoPE of the sliding-window layers, when their base differs.
    rope_sliding: Option<RopeTable>,
    /// This rank's heads, per layer of the shard.
    attn: Vec<AttentionParams>,
    local_kv_heads: usize,
    comm: Arc<dyn Collectives>,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("info", &self.info)
            .field("rank", &self.comm.rank())
            .finish()
    }
}

/// The layer name the KV cache (and the checksum) uses for layer `i`.
pub fn layer_name(i: usize) -> String {
    format!("model.layers.{i}.self_attn")
}

impl Decoder {
    pub fn config(&self) -> &DecoderConfig {
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
        batch.validate(block_size, self.rope_full.max_positions())?;
        let t = batch.num_tokens();
        if t == 0 {
            return Ok(Vec::new());
        }
        let h = c.hidden_size;
        let hd = c.head_dim;
        let f = &c.features;
        let eps = c.rms_norm_eps;

        let mut x = match &self.embed {
            Some(embed) => {
                let mut x = embed.rows(batch.token_ids)?;
                if let Some(s) = f.embed_scale {
                    x.iter_mut().for_each(|v| *v *= s);
                }
                x
            }
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
            let params = &self.attn[l];
            let (qd, kvd) = (params.num_heads * hd, params.num_kv_heads * hd);
            let norms = &layer.norms;
            let hn = rms_norm_to(&x, &norms.attn, eps);
            let qkv = layer.qkv.forward(&hn, t)?;
            let mut q = Vec::with_capacity(t * qd);
            let mut k = Vec::with_capacity(t * kvd);
            let mut v = Vec::with_capacity(t * kvd);
            for row in qkv.chunks_exact(qd + 2 * kvd) {
                q.extend_from_slice(&row[..qd]);
                k.extend_from_slice(&row[qd..qd + kvd]);
                v.extend_from_slice(&row[qd + kvd..]);
            }
            if let (Some(qn), Some(kn)) = (&norms.q, &norms.k) {
                rms_norm(&mut q, qn, eps);
                rms_norm(&mut k, kn, eps);
            }
            let rope = match (params.window, &self.rope_sliding) {
                (Some(_), Some(local)) => local,
                _ => &self.rope_full,
            };
            rope.apply(&mut q, batch.positions, hd);
            rope.apply(&mut k, batch.positions, hd);
            let slot = self.storage_layer[l];
            kv.write_slots(slot, batch.slots(params.kv_group), &k, &v)?;
            let attn =
                paged_attention(&q, batch.seqs, LayerCache::from_storage(kv, slot)?, params)?;
            let mut o = layer.o.forward(&attn, t)?;
            self.comm.all_reduce_sum(&mut o)?;
            if let Some(n) = &norms.post_attn {
                rms_norm(&mut o, n, eps);
            }
            add_assign(&mut x, &o);
            let hn = rms_norm_to(&x, &norms.ffn, eps);
            let gate_up = layer.gate_up.forward(&hn, t)?;
            let width = c.intermediate_size / self.comm.config().tp;
            let act = match f.activation {
                Activation::Silu => silu_mul(&gate_up, width),
                Activation::GeluTanh => gelu_tanh_mul(&gate_up, width),
            };
            let mut d = layer.down.forward(&act, t)?;
            self.comm.all_reduce_sum(&mut d)?;
            if let Some(n) = &norms.post_ffn {
                rms_norm(&mut d, n, eps);
            }
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
}

impl CausalLm for Decoder {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Group 0: the shard's full-attention layers; group 1: its sliding-window layers (group 0
    /// when the whole model slides). A group this shard has no layer of is left out; the ids
    /// are the model's, the same on every rank ([`Features::kv_group`]).
    fn kv_cache_groups(&self, block_size: usize, dtype: CacheDtype) -> Vec<KvCacheGroup> {
        let names = |sliding: bool| -> Vec<String> {
            self.layer_range
                .clone()
                .zip(&self.attn)
                .filter(|(_, p)| p.window.is_some() == sliding)
                .map(|(i, _)| layer_name(i))
                .collect()
        };
        let (full, sliding) = (names(false), names(true));
        let mut groups = Vec::new();
        if !full.is_empty() {
            groups.push(KvCacheGroup {
                group_id: 0,
                spec: KvCacheSpec::FullAttention {
                    block_size,
                    num_kv_heads: self.local_kv_heads,
                    head_dim: self.cfg.head_dim,
                    dtype,
                },
                layer_names: full,
            });
        }
        if !sliding.is_empty() {
            let layer = self.attn.iter().find(|p| p.window.is_some());
            let window = layer.and_then(|p| p.window).unwrap_or(0);
            groups.push(KvCacheGroup {
                group_id: layer.map_or(1, |p| p.kv_group),
                spec: KvCacheSpec::SlidingWindow {
                    block_size,
                    num_kv_heads: self.local_kv_heads,
                    head_dim: self.cfg.head_dim,
                    dtype,
                    window,
                },
                layer_names: sliding,
            });
        }
        groups
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

#[cfg(feature = "cuda")]
impl DecoderWeights {
    pub(crate) fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// The f32 values of one tensor in the GPU decoder's fused layout (Q, K, V rows in one
    /// matrix, gate and up rows in one).
    pub(crate) fn gpu_tensor(
        &self,
        tensor: tandem_kernels::cuda::Tensor,
    ) -> Result<Vec<f32>, ModelError> {
        use tandem_kernels::cuda::Tensor;
        let layer = |l: usize| {
            self.layers
                .get(l)
                .ok_or_else(|| ModelError::format(format!("no layer {l}")))
        };
        match tensor {
            Tensor::Embedding => self.embed.to_f32(),
            Tensor::Output => self.head.as_ref().unwrap_or(&self.embed).to_f32(),
            Tensor::FinalNorm => Ok(self.norm.clone()),
            Tensor::AttnNorm(l) => Ok(layer(l)?.norms.attn.clone()),
            Tensor::FfnNorm(l) => Ok(layer(l)?.norms.ffn.clone()),
            Tensor::Qkv(l) => {
                let w = layer(l)?;
                HostMatrix::concat_rows(&[w.q.clone(), w.k.clone(), w.v.clone()])?.to_f32()
            }
            Tensor::AttnOutput(l) => layer(l)?.o.to_f32(),
            Tensor::GateUp(l) => {
                let w = layer(l)?;
                HostMatrix::concat_rows(&[w.gate.clone(), w.up.clone()])?.to_f32()
            }
            Tensor::Down(l) => layer(l)?.down.to_f32(),
        }
    }
}
