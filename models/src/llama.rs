//! The Llama family's hyper-parameters (Llama 2/3, SmolLM, TinyLlama, …): RMSNorm, RoPE with the
//! model's theta and scaling, grouped-query attention, SwiGLU, optionally tied embeddings, read
//! from GGUF metadata or a Hugging Face `config.json`. The forward is the shared decoder's
//! ([`crate::decoder`]) with [`Features::llama`].

use crate::decoder::{DecoderConfig, Features};
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::ops::RopeScaling;

impl DecoderConfig {
    /// From GGUF metadata (`{arch}.*` keys) and the presence of tensors.
    pub fn from_llama_gguf(g: &mut GgufFile) -> Result<Self, ModelError> {
        let arch = g.str("general.architecture")?.to_owned();
        if arch != "llama" {
            return Err(ModelError::Unsupported(format!(
                "GGUF architecture `{arch}` (supported: llama, gemma3)"
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
        Ok(DecoderConfig {
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
            features: Features::llama(),
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
        Ok(DecoderConfig {
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
            features: Features::llama(),
        })
    }
}
