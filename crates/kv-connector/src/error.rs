//! The one error type of the KV connector crate.

/// Errors of KV connectors: bad transfer parameters, failed handshakes and transfers.
#[derive(Debug, thiserror::Error)]
pub enum KvConnectorError {
    /// `kv_transfer_params` of a request that cannot be used (client's or producer's mistake).
    #[error("invalid kv_transfer_params: {0}")]
    InvalidTransferParams(String),
    /// `--kv-transfer-config` that cannot be honoured.
    #[error("invalid kv_transfer_config: {0}")]
    InvalidConfig(String),
}
