//! The OpenAI-compatible HTTP server of one Tandem instance, and the `tandem` binary's pieces.
//!
//! - [`advertise`]: `TANDEM_NIXL_SIDE_CHANNEL_HOST=auto`, an instance's own address and interface.
//! - [`config`]: `tandem serve`'s flags (each also `TANDEM_*` and TOML).
//! - [`protocol`]: request and response bodies; [`fields`]: fields beyond them (refused or not).
//! - [`extract`]: the JSON extractor whose rejections are OpenAI envelopes.
//! - [`routes`]: the router and handlers; [`generate`]: engine events to responses;
//!   [`tokenize`]: `/tokenize`, `/detokenize`, `/version`.
//! - [`error`]: the one mapping of errors to HTTP status and envelope.
//! - [`bench`]: `tandem bench`, a load generator for a running endpoint.
//! - [`launch`]: loading the model, sizing the KV cache, starting engine and server;
//!   [`kv_pools`]: the KV blocks of each cache group.
//! - [`probe`]: `tandem health URL`, the healthcheck of container images without curl.

pub mod advertise;
pub mod bench;
pub mod config;
pub mod error;
pub mod extract;
pub mod fields;
pub mod generate;
pub mod guided;
pub mod kv_pools;
pub mod launch;
pub mod probe;
pub mod protocol;
pub mod routes;
pub mod state;
pub mod tokenize;
pub mod tools;

pub use routes::app;
pub use state::AppState;
