//! Tandem's models: architectures written on candle that read and write the engine's paged KV
//! cache, their loaders (GGUF; Hugging Face safetensors directories), tokenizers and chat
//! templates.
//!
//! - [`model`]: the engine-facing interface ([`CausalLm`], [`ForwardBatch`], [`ModelInfo`]).
//! - [`loader`]: `--model` resolution and [`load_model`].
//! - [`decoder`]: the decoder-only transformer the architectures share (whole or one rank's
//!   shard); [`llama`] and [`gemma3`]: their hyper-parameters. One module per architecture.
//! - [`attention`]: CPU paged attention over [`tandem_kv_cache::KvStorage`].
//! - [`ops`]: RMSNorm, RoPE, SwiGLU and small vector kernels.
//! - [`cpu`]: which instruction set the hot kernels run ([`cpu::Isa`]), picked at run time.
//! - [`weights`]: weight modes and matrices ([`WeightMode`]); `q4_1`: our batched Q4_1 matmul.
//! - [`gguf`], `hf`: file formats; `dummy`: random weights of a config's shapes.
//! - [`tokenizer`], [`chat_template`]: text in and out.
//! - [`gpu_batch`]: the models and batches the GPU decoder takes (host side; `cuda`: the decoder).
//!
//! Invariant across the crate: the model never owns KV state; everything a sequence has seen
//! lives in the engine's cache, addressed by block tables, so a step's result for one sequence
//! depends only on that sequence's tokens and cache.

pub mod attention;
pub mod chat_template;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decoder;
mod dummy;
pub mod error;
pub mod gemma3;
pub mod gguf;
pub mod gpu_batch;
mod hf;
pub mod llama;
pub mod loader;
pub mod model;
pub mod ops;
pub mod quant;
pub mod tokenizer;
pub mod weights;

pub use chat_template::{ChatMessage, ChatTemplate};
pub use error::ModelError;
pub use loader::{
    load_model, load_tokenizer, resolve_model, LoadFormat, LoadOptions, LoadedModel, ModelSource,
};
pub use model::{CausalLm, ForwardBatch, ModelInfo, SeqBatch};
pub use tandem_parallel::{ParallelConfig, RankId};
pub use tokenizer::{IncrementalDetokenizer, TextTokenizer};
pub use weights::WeightMode;
