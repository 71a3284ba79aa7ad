//! `tandem-proxy`: the HTTP front of a prefill/decode (P/D) deployment, run as `tandem proxy`.
//!
//! A client talks to the proxy as to one OpenAI-compatible server. For each
//! `/v1/completions` or `/v1/chat/completions` request the proxy (see `forward`):
//! 1. drops any `kv_transfer_params` the client sent (never trusted) and names the request with
//!    one `X-Request-Id` (the client's, else a UUID) used on both upstream calls;
//! 2. sends a prefill instance a copy with `max_tokens: 1`, `stream: false` and
//!    `kv_transfer_params: {"do_remote_decode": true}`, and reads back the producer's
//!    `kv_transfer_params` (all keys, untouched; none is a 502);
//! 3. sends the original request plus those params to a decode instance, and relays its status,
//!    content type and body to the client chunk by chunk (SSE or JSON), without buffering.
//!
//! Instances of a role are picked by least outstanding requests (ties round-robin) among the
//! healthy ones (`pool`); background health checks take dead ones out and bring them back
//! (`ProxyState::spawn_health_checks`). Errors are OpenAI envelopes (`error`): 400 for a body
//! that is not a JSON object, 503 when a role has no healthy instance, 502 when an upstream
//! cannot be reached or answers badly, 504 on a timeout; an upstream's own OpenAI error is
//! passed through with its status. A client that disconnects drops the relayed body, which
//! closes the decode connection. Metrics are named in `telemetry`.
//!
//! Hardening: the listener is served by `tandem_http_edge::serve` (`--max-connections`,
//! `--header-read-timeout-secs`, bounded graceful shutdown); `--api-key` is asked of clients on
//! every route but `/health` and `/metrics` (`routes`); upstream calls carry the proxy's own
//! `--upstream-api-key`, never the client's `Authorization` (`state`). Before any prefill the
//! body's token limits are checked (400) and a decode instance must be in rotation (503). A
//! failed decode call releases the producer's blocks at once (`release`); a decode SSE stream
//! that breaks ends for the client with an error event and `[DONE]` (`forward`).

mod config;
mod dashboard;
mod discovery;
mod error;
mod forward;
mod pool;
mod release;
mod request;
mod routes;
mod state;
pub mod telemetry;

use std::future::Future;

pub use config::ProxyArgs;
pub use error::ProxyError;
pub use pool::{InstanceStatus, Role};
pub use release::RELEASE_PATH;
pub use request::{KV_TRANSFER_PARAMS, X_REQUEST_ID};
pub use routes::{app, OPEN_PATHS};
pub use state::{ProxyState, ProxyStatus};

/// Runs the proxy until ctrl-c or SIGTERM: installs the global Prometheus recorder (for
/// `/metrics`), binds `--host:--port`, starts the health checks and serves [`app`].
///
/// A binary that installs its own recorder builds the state with its handle and calls
/// [`serve_with`] instead.
pub async fn serve(args: ProxyArgs) -> Result<(), ProxyError> {
    let handle = telemetry::install_prometheus_recorder()?;
    let addr = (args.host.clone(), args.port);
    let state = ProxyState::new(args, Some(handle))?;
    let listener = tokio::net::TcpListener::bind(addr.clone())
        .await
        .map_err(|source| ProxyError::Bind {
            addr: format!("{}:{}", addr.0, addr.1),
            source,
        })?;
    serve_with(listener, state, shutdown_signal()).await
}

/// Serves [`app`] on `listener` through `tandem_http_edge::serve` (the state's connection limit
/// and header read timeout) with the state's health checks running, until `shutdown` completes;
/// then stops taking connections and waits (bounded) for the answers in flight.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    state: ProxyState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ProxyError> {
    let status = state.status();
    tracing::info!(
        addr = ?listener.local_addr().ok(),
        prefill = ?status.prefill.iter().map(|i| &i.url).collect::<Vec<_>>(),
        decode = ?status.decode.iter().map(|i| &i.url).collect::<Vec<_>>(),
        "tandem proxy listening"
    );
    let health = state.spawn_health_checks();
    let limits = state.settings().edge;
    let result = tandem_http_edge::serve(listener, app(state), limits, shutdown)
        .await
        .map_err(ProxyError::Serve);
    health.abort();
    tracing::info!("tandem proxy stopped");
    result
}

/// Completes on ctrl-c or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("ctrl-c received, shutting down"),
        () = terminate => tracing::info!("SIGTERM received, shutting down"),
    }
}
