//! The NIXL transport: moving bytes of KV blocks between two processes with real NIXL (UCX).
//!
//! - [`library`]: finds and loads `libnixl_capi.so` before any NIXL call (never aborts), and sets
//!   UCX's network-device default.
//! - [`agent`]: [`NixlAgent`], one agent over one worker's KV memory: registration, metadata,
//!   peers with descriptor lists prepared once, notifications.
//! - [`handshake`]: [`NixlHandshake`], what instances exchange before a transfer, and the
//!   compatibility check.
//! - [`descriptors`]: block → descriptor index geometry and the plan of one transfer.
//! - [`pairing`]: which of a peer's regions and heads feed which of ours when the two instances
//!   split the model differently (TP, PP, replicated heads).
//! - [`transfer`]: [`NixlAgent::read_blocks`] / [`NixlAgent::write_blocks`], [`TransferHandle`].
//!
//! Invariant: nothing here knows about requests or the scheduler; callers pass block ids they own
//! and get bytes moved, notifications, and per-transfer statistics back.

pub mod agent;
pub mod descriptors;
pub mod handshake;
pub mod library;
pub mod pairing;
pub mod transfer;

pub use agent::{
    storage_layers, KvLayerMemory, NixlAgent, NixlAgentConfig, DEFAULT_PROGRESS_DELAY_US,
};
pub use descriptors::{BlockPairs, GroupPairs, Side};
pub use handshake::{
    compat_hash, HandshakeMismatch, LayerInfo, NixlHandshake, RegionInfo,
    HANDSHAKE_PROTOCOL_VERSION,
};
pub use library::{load_nixl, nixl_loaded, NixlLibrary, DEFAULT_UCX_NET_DEVICES, LIB_DIR_ENV};
pub use transfer::{TransferHandle, TransferOp, TransferStats, TransferStatus};

use crate::error::KvConnectorError;

/// Wraps a `nixl_sys` error of operation `op` (outside of a transfer).
pub(crate) fn nixl_err(op: &'static str, err: nixl_sys::NixlError) -> KvConnectorError {
    KvConnectorError::Nixl {
        op,
        reason: err.to_string(),
    }
}
