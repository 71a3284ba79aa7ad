//! The one error type of the engine crate. The server maps it to HTTP once.

/// Errors of the engine: bad requests (the client's fault) and engine failures (ours).
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum EngineError {
    /// A request parameter is out of range; `param` names it for the error envelope.
    #[error("{message}")]
    InvalidParam { param: String, message: String },
    /// The prompt and the requested output do not fit the model's context.
    #[error("This model's maximum context length is {max_model_len} tokens. However, you requested {requested} tokens ({prompt} in the prompt, {max_tokens} for the completion). Please reduce the length of the prompt or the completion.")]
    ContextLengthExceeded {
        max_model_len: usize,
        requested: usize,
        prompt: usize,
        max_tokens: usize,
    },
    /// The request can never be scheduled: it needs more KV blocks than the cache holds.
    #[error("the request needs {needed} KV blocks but the cache holds only {available}")]
    TooLargeForCache { needed: usize, available: usize },
    /// The KV cache for this request could not be loaded from the remote instance.
    #[error("KV load failed: {0}")]
    KvLoadFailed(String),
    /// The request's `kv_transfer_params` were rejected.
    #[error("{0}")]
    InvalidTransferParams(String),
    /// The engine thread has stopped.
    #[error("the engine is not running")]
    EngineDead,
    /// The model failed during a step.
    #[error("model execution failed: {0}")]
    Execution(String),
    /// The engine's configuration cannot work (found at startup).
    #[error("invalid engine configuration: {0}")]
    InvalidConfig(String),
}

impl EngineError {
    /// Whether the client caused the error (4xx) rather than the server (5xx).
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            EngineError::InvalidParam { .. }
                | EngineError::ContextLengthExceeded { .. }
                | EngineError::TooLargeForCache { .. }
                | EngineError::InvalidTransferParams(_)
        )
    }
}
