//! KV connectors: how a request's KV cache moves between instances.
//!
//! - [`base`]: the connector interface, split like vLLM's into a scheduler side (which tokens come
//!   from elsewhere, when a request's blocks may be freed) and a worker side (register caches,
//!   start loads, report finished transfers), plus the no-op connector of a single instance.
//! - [`nixl`]: the NIXL transport under the worker side: agents over the worker's KV memory, the
//!   handshake between instances, block READs/WRITEs and notifications.
//! - [`config`]: [`KvTransferConfig`], the `--kv-transfer-config` JSON (vLLM's keys, defaults).
//! - [`params`]: `kv_transfer_params`, parsed and validated ([`params::TransferRequest`]).
//! - [`pull`]: the NIXL pull connector ([`pull::nixl_pull_connector`]): producer leases,
//!   consumer READs on a transfer thread, the handshake the server serves.
//! - [`push`]: the NIXL push connector ([`push::nixl_push_connector`]): consumer registrations,
//!   producer WRITEs with the checksums on their completion notification.
//! - [`auth`]: the deployment secret: signed `kv_transfer_params` and signed peer requests.
//! - [`allowlist`]: `allowed_producers`, the producers a consumer may contact.
//! - [`error`]: the crate's error type.

pub mod allowlist;
pub mod auth;
pub mod base;
pub mod config;
pub mod error;
pub mod nixl;
pub mod params;
pub mod pull;
pub mod push;

pub use config::{KvMode, KvRole, KvTransferConfig, LoadFailurePolicy};
pub use error::KvConnectorError;
pub use pull::{nixl_pull_connector, HandshakeProvider, NixlPullConnector, HANDSHAKE_PATH};
pub use push::{nixl_push_connector, NixlPushConnector};
