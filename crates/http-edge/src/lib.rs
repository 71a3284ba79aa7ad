//! `tandem-http-edge`: the HTTP edge that both binaries (the instance server and the proxy) put
//! in front of their axum routers.
//!
//! It owns what happens before a request reaches a handler:
//! - [`serve`]: the accept loop, on hyper-util's connection builder (HTTP/1.1), with a cap on
//!   live connections, a header read timeout (also closing idle keep-alive connections) and a
//!   bounded graceful shutdown (`serve`);
//! - [`require_api_key`]: the bearer API-key check, answering 401 with the OpenAI envelope
//!   (`auth`);
//! - [`EdgeLimits`] and [`ApiKey`], the settings a binary exposes as its own flags (`limits`);
//! - the metric names of the edge (`metrics`).
//!
//! Invariants: a connection is served only while it holds one of `max_connections` permits, so
//! live connections never exceed the limit and one over it is closed at once (its fd freed); no
//! connection waits for its request headers longer than `header_read_timeout`; an API key is
//! never printed (`Debug` redacts it) and is compared in constant time.

mod auth;
mod error;
mod limits;
pub mod metrics;
mod serve;

pub use auth::{require_api_key, unauthorized_envelope};
pub use error::EdgeError;
pub use limits::{ApiKey, EdgeLimits, DEFAULT_HEADER_READ_TIMEOUT_SECS, DEFAULT_MAX_CONNECTIONS};
pub use serve::{serve, serve_with_stats, EdgeStats};
