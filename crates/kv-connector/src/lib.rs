//! KV connectors: how a request's KV cache moves between instances.
//!
//! - [`base`]: the connector interface, split like vLLM's into a scheduler side (which tokens come
//!   from elsewhere, when a request's blocks may be freed) and a worker side (register caches,
//!   start loads, report finished transfers), plus the no-op connector of a single instance.
//! - [`nixl`]: the NIXL transport under the worker side: agents over the worker's KV memory, the
//!   handshake between instances, block READs/WRITEs and notifications.
//! - [`error`]: the crate's error type.

pub mod base;
pub mod error;
pub mod nixl;

pub use error::KvConnectorError;
