//! The one error type of the models crate.
//!
//! Variants are classified by who is at fault: a model that cannot be found or read
//! (`NotFound`, `Io`, `Format`, `Unsupported`), text the tokenizer or template rejects
//! (`Tokenizer`, `Template`), a batch the engine built wrongly (`InvalidBatch`), and
//! failures of the libraries underneath (`Candle`, `KvCache`).

use std::path::PathBuf;

/// Errors of model loading, tokenization, chat templating and the forward pass.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model `{spec}` not found: {reason}")]
    NotFound { spec: String, reason: String },
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid model file: {0}")]
    Format(String),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    KvCache(#[from] tandem_kv_cache::KvCacheError),
    /// A layout the model cannot be split into, or a collective that failed in a step.
    #[error("parallel: {0}")]
    Parallel(#[from] tandem_parallel::ParallelError),
    /// The GPU, its driver or a GPU kernel failed (the `cuda` feature).
    #[cfg(feature = "cuda")]
    #[error("GPU: {0}")]
    Gpu(#[from] tandem_kernels::KernelError),
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
    pub(crate) fn format(msg: impl Into<String>) -> Self {
        ModelError::Format(msg.into())
    }
}
