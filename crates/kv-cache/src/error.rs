//! The one error type of the KV cache crate.

/// Errors of the KV cache: configuration that cannot be honoured, and out-of-range access.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum KvCacheError {
    #[error("invalid KV cache configuration: {0}")]
    InvalidConfig(String),
    #[error("block {block} is out of range (pool has {num_blocks} blocks)")]
    BlockOutOfRange { block: usize, num_blocks: usize },
    #[error("layer {layer} is out of range ({num_layers} layers)")]
    LayerOutOfRange { layer: usize, num_layers: usize },
    #[error("slot {slot} is out of range ({num_slots} slots)")]
    SlotOutOfRange { slot: usize, num_slots: usize },
    #[error("expected {expected} values, got {got}")]
    LengthMismatch { expected: usize, got: usize },
    /// The arrays live in another memory (a GPU's): the host cannot read or write them here.
    #[error("the KV cache lives in device memory: no host access to its blocks")]
    NotInHostMemory,
    /// A device copy failed, or a storage was given a device memory that does not fit it.
    #[error("device KV memory: {0}")]
    Device(String),
}
