//! `--load-format dummy`: deterministic random weights of the shapes an HF-style `config.json`
//! gives, for running any layout (TP, KV heads, an 8B shape) without downloading weights.
//!
//! Each tensor's values come from a small PRNG seeded by the tensor's name, so every process
//! and every rank sees the same model, and a shard cut from it equals the same rows of the whole.
//! Matrices are uniform in `±sqrt(3 / cols)` (unit variance out for unit variance in), the
//! output layer four times that, so that logits spread and greedy choices are rarely near-ties;
//! norm weights are 1.

use crate::decoder::{DecoderConfig, WeightSource};
use crate::error::ModelError;
use crate::weights::HostMatrix;
use rayon::prelude::*;

/// The weights of a dummy model of config `cfg`.
pub(crate) struct DummySource {
    cfg: DecoderConfig,
}

impl DummySource {
    pub(crate) fn new(cfg: &DecoderConfig) -> Self {
        DummySource { cfg: cfg.clone() }
    }

    /// `[rows, cols]` of a tensor, by its llama.cpp name.
    fn shape(&self, name: &str) -> Option<(usize, usize)> {
        let c = &self.cfg;
        let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let kind = name
            .strip_prefix("blk.")
            .and_then(|rest| rest.split_once('.'))
            .map_or(name, |(_, kind)| kind);
        Some(match kind {
            "token_embd.weight" | "output.weight" => (c.vocab_size, h),
            "attn_q.weight" => (qd, h),
            "attn_k.weight" | "attn_v.weight" => (kvd, h),
            "attn_output.weight" => (h, qd),
            "ffn_gate.weight" | "ffn_up.weight" => (i, h),
            "ffn_down.weight" => (h, i),
            _ => return None,
        })
    }
}

/// splitmix64's increment.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64: a tiny, well-mixed generator (seeded per tensor).
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(GOLDEN);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of the name: the tensor's seed.
fn seed(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

impl WeightSource for DummySource {
    fn has(&self, name: &str) -> bool {
        match name {
            "output.weight" => !self.cfg.tie_word_embeddings,
            _ => self.shape(name).is_some() || name.ends_with("norm.weight"),
        }
    }

    fn vector(&mut self, name: &str) -> Result<Vec<f32>, ModelError> {
        if name.ends_with("norm.weight") {
            Ok(vec![1.0; self.cfg.hidden_size])
        } else {
            Err(ModelError::format(format!(
                "dummy model has no vector `{name}`"
            )))
        }
    }

    fn matrix(&mut self, name: &str, _qk_heads: Option<usize>) -> Result<HostMatrix, ModelError> {
        let (rows, cols) = self
            .shape(name)
            .ok_or_else(|| ModelError::format(format!("dummy model has no matrix `{name}`")))?;
        let mut scale = (3.0 / cols as f64).sqrt() as f32;
        let tied_head = name == "token_embd.weight" && self.cfg.tie_word_embeddings;
        if name == "output.weight" || tied_head {
            scale *= 4.0;
        }
        let start = seed(name);
        // splitmix64's state after i draws is start + i * GOLDEN: each value is computed on its
        // own, in parallel (an 8B shape's 8 billion values), and equals the sequential stream.
        let data = (0..(rows * cols) as u64)
            .into_par_iter()
            .map(|i| {
                let mut state = start.wrapping_add(i.wrapping_mul(GOLDEN));
                // 24 random bits -> [-1, 1)
                let u = (splitmix64(&mut state) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                u * scale
            })
            .collect();
        HostMatrix::from_f32(rows, cols, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> DecoderConfig {
        DecoderConfig::from_hf_json(&serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 8, "vocab_size": 300, "tie_word_embeddings": false}))
        .unwrap()
    }

    #[test]
    fn values_are_the_sequential_splitmix_stream() {
        let name = "blk.0.attn_k.weight";
        let m = DummySource::new(&cfg()).matrix(name, None).unwrap();
        let got = m.to_f32().unwrap();
        let scale = (3.0f32 / 64.0).sqrt();
        let mut state = seed(name);
        for (i, v) in got.iter().enumerate() {
            let u = (splitmix64(&mut state) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            assert_eq!(*v, u * scale, "value {i}");
        }
    }

    #[test]
    fn tensors_are_deterministic_and_shaped_by_the_config() {
        let mut a = DummySource::new(&cfg());
        let mut b = DummySource::new(&cfg());
        let q = a.matrix("blk.1.attn_q.weight", Some(8)).unwrap();
        assert_eq!((q.rows, q.cols), (64, 64));
        assert_eq!(
            q.to_f32().unwrap(),
            b.matrix("blk.1.attn_q.weight", None)
                .unwrap()
                .to_f32()
                .unwrap()
        );
        let k0 = a
            .matrix("blk.0.attn_k.weight", None)
            .unwrap()
            .to_f32()
            .unwrap();
        let k1 = a
            .matrix("blk.1.attn_k.weight", None)
            .unwrap()
            .to_f32()
            .unwrap();
        assert_eq!(k0.len(), 16 * 64);
        assert_ne!(k0, k1, "layers differ");
        let bound = (3.0f32 / 64.0).sqrt();
        assert!(k0.iter().all(|x| x.abs() <= bound));
        assert!(
            a.has("output.weight") && a.matrix("blk.0.ffn_down.weight", None).unwrap().cols == 128
        );
        assert!(a.matrix("blk.0.nonsense.weight", None).is_err());
        assert_eq!(a.vector("blk.0.attn_norm.weight").unwrap(), vec![1.0; 64]);
    }
}
