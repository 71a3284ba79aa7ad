//! Gemma 3's hyper-parameters and chat format, read from a GGUF (`general.architecture` =
//! `gemma3`), for the shared decoder ([`crate::decoder`]).
//!
//! As transformers computes it: every sixth layer (5, 11, 17, …) attends to the whole context
//! with RoPE base `gemma3.rope.freq_base`; the others attend to a sliding window of
//! `gemma3.attention.sliding_window` tokens with RoPE base 10000; query and key RMSNorms per
//! head; RMSNorms after attention and after the MLP; the embedding scaled by
//! `sqrt(hidden_size)`; GeGLU (tanh GELU); scores scaled by `1/sqrt(head_dim)`
//! (`query_pre_attn_scalar` is `head_dim` in the released models); the output layer tied to the
//! embedding. llama.cpp's GGUF stores the norm weights with Gemma's `+1` already added, so they
//! multiply as they are.
//!
//! The released GGUF carries no chat template: [`CHAT_TEMPLATE`] is Gemma's turn format
//! (`<start_of_turn>user … <end_of_turn>`, the assistant as `model`, a system message folded into
//! the first user turn), written for Tandem.

use crate::decoder::{Activation, DecoderConfig, Features};
use crate::error::ModelError;
use crate::gguf::GgufFile;

/// Layers `i` with `(i + 1) % SLIDING_PATTERN == 0` are full attention.
const SLIDING_PATTERN: usize = 6;
/// RoPE base of the sliding-window layers.
const SLIDING_ROPE_THETA: f32 = 10_000.0;

/// Gemma's chat format, for GGUFs without a template.
pub const CHAT_TEMPLATE: &str = "{{ bos_token }}{% set system = namespace(text='') %}\
{% for m in messages %}{% if m['role'] == 'system' %}{% set system.text = m['content'] + '\n\n' %}\
{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n\
{{ system.text }}{{ m['content'] | trim }}<end_of_turn>\n{% set system.text = '' %}\
{% endif %}{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";

impl DecoderConfig {
    /// From a Gemma 3 GGUF's metadata.
    pub fn from_gemma3_gguf(g: &mut GgufFile) -> Result<Self, ModelError> {
        let k = |s: &str| format!("gemma3.{s}");
        let hidden_size = g.usize(&k("embedding_length"))?;
        let num_heads = g.usize(&k("attention.head_count"))?;
        let num_layers = g.usize(&k("block_count"))?;
        let head_dim = g
            .opt_usize(&k("attention.key_length"))
            .unwrap_or(hidden_size / num_heads.max(1));
        let window = g.usize(&k("attention.sliding_window"))?;
        let vocab_size = match g.opt_usize(&k("vocab_size")) {
            Some(v) => v,
            None => g.str_array("tokenizer.ggml.tokens")?.len(),
        };
        if let Some(scaling) = g.opt_str(&k("rope.scaling.type")).filter(|s| *s != "none") {
            return Err(ModelError::Unsupported(format!(
                "Gemma 3 RoPE scaling `{scaling}` (the 270M and 1B models have none)"
            )));
        }
        Ok(DecoderConfig {
            hidden_size,
            intermediate_size: g.usize(&k("feed_forward_length"))?,
            num_layers,
            num_heads,
            num_kv_heads: g
                .opt_usize(&k("attention.head_count_kv"))
                .unwrap_or(num_heads),
            head_dim,
            vocab_size,
            max_position_embeddings: g.opt_usize(&k("context_length")).unwrap_or(32_768),
            rope_theta: g.opt_f32(&k("rope.freq_base")).unwrap_or(1_000_000.0),
            rope_scaling: None,
            rms_norm_eps: g
                .opt_f32(&k("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-6),
            tie_word_embeddings: !g.has_tensor("output.weight"),
            features: Features {
                arch: "gemma3",
                layer_windows: (0..num_layers)
                    .map(|i| (!(i + 1).is_multiple_of(SLIDING_PATTERN)).then_some(window))
                    .collect(),
                rope_theta_sliding: Some(SLIDING_ROPE_THETA),
                attn_scale: Some(1.0 / (head_dim as f32).sqrt()),
                embed_scale: Some((hidden_size as f32).sqrt()),
                qk_norm: true,
                post_norms: true,
                activation: Activation::GeluTanh,
                gguf_permuted_qk: false,
            },
        })
    }
}
