//! The one error type of the KV connector crate.

/// Errors of KV connectors: bad transfer parameters, failed handshakes and transfers.
#[derive(Debug, thiserror::Error)]
pub enum KvConnectorError {
    /// `kv_transfer_params` of a request that cannot be used (client's or producer's mistake).
    #[error("invalid kv_transfer_params: {0}")]
    InvalidTransferParams(String),
    /// Params or a peer request without a valid signature of the deployment's secret.
    #[error("KV transfer refused: {0}")]
    Unauthorized(String),
    /// Signed params past their `expires_at`.
    #[error("KV transfer refused: {0}")]
    Expired(String),
    /// A producer outside `allowed_producers`.
    #[error("KV transfer refused: {0}")]
    ProducerNotAllowed(String),
    /// A producer would not let this consumer read a request's blocks (no live lease with those
    /// blocks, or one already claimed).
    #[error("KV lease refused: {0}")]
    LeaseRefused(String),
    /// `--kv-transfer-config` that cannot be honoured.
    #[error("invalid kv_transfer_config: {0}")]
    InvalidConfig(String),

    // --- NIXL transport (`crate::nixl`) ---
    /// `libnixl_capi.so` was not found in any searched directory.
    #[error(
        "NIXL library not found: looked in {searched}; run scripts/setup.sh or set TANDEM_NIXL_LIB_DIR"
    )]
    NixlLibraryNotFound { searched: String },
    /// The library file exists but `dlopen` refused it (wrong architecture, missing dependency).
    #[error("NIXL library {path} could not be loaded: {reason}")]
    NixlLibraryLoad {
        path: std::path::PathBuf,
        reason: String,
    },
    /// A NIXL call failed outside of a transfer (agent, backend, registration, metadata).
    #[error("NIXL {op} failed: {reason}")]
    Nixl { op: &'static str, reason: String },
    /// A transfer could not be posted or failed in flight (peer dead, connection reset).
    #[error("NIXL {op} with peer {peer} failed: {reason}")]
    TransferFailed {
        op: &'static str,
        peer: String,
        reason: String,
    },
    /// A transfer did not complete within the caller's deadline; it may still be in flight.
    #[error("NIXL {op} with peer {peer} did not complete within {timeout:?}")]
    TransferTimeout {
        op: &'static str,
        peer: String,
        timeout: std::time::Duration,
    },
    /// A transfer or notification named a peer whose handshake was never accepted (or removed).
    #[error("unknown NIXL peer {0:?}: no handshake accepted for it")]
    UnknownPeer(String),
    /// A peer's handshake does not match ours.
    #[error("incompatible KV peer (engine {engine_id}): {mismatch}")]
    IncompatiblePeer {
        engine_id: String,
        mismatch: crate::nixl::HandshakeMismatch,
    },
    /// A handshake could not be parsed or is internally inconsistent.
    #[error("invalid NIXL handshake: {0}")]
    InvalidHandshake(String),
    /// A transfer named a block id outside one side's cache.
    #[error("{side} block id {block} out of range (the {side} cache has {num_blocks} blocks)")]
    BlockOutOfRange {
        side: crate::nixl::Side,
        block: usize,
        num_blocks: usize,
    },
    /// A transfer would write one destination block twice.
    #[error("{side} block id {block} appears twice among a transfer's destination blocks")]
    DuplicateBlock {
        side: crate::nixl::Side,
        block: usize,
    },
    /// The local and remote block id lists of a transfer differ in length.
    #[error("{local} local block ids but {remote} remote block ids")]
    BlockCountMismatch { local: usize, remote: usize },
    /// KV memory that cannot be described to NIXL (no layers, blocks not fitting their region).
    #[error("invalid KV regions: {0}")]
    InvalidRegions(String),
}

impl KvConnectorError {
    /// The `reason` label of `tandem:kv_transfer_refused_total` for a refusal of params or a
    /// peer request; `None` for errors that are not refusals.
    pub fn refusal_reason(&self) -> Option<&'static str> {
        match self {
            KvConnectorError::Unauthorized(_) => Some("unauthorized"),
            KvConnectorError::Expired(_) => Some("expired"),
            KvConnectorError::ProducerNotAllowed(_) => Some("producer_not_allowed"),
            KvConnectorError::LeaseRefused(_) => Some("lease"),
            KvConnectorError::InvalidTransferParams(_) => Some("malformed"),
            _ => None,
        }
    }
}
