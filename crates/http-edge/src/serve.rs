//! The accept loop: every connection of a listener served by hyper-util's connection builder
//! (HTTP/1.1) under [`EdgeLimits`], until a shutdown signal, then drained within a bound.
//!
//! Invariants:
//! - a connection is served only while it holds one of `max_connections` semaphore permits
//!   (taken before it is served, given back when its task ends), so live connections never
//!   exceed the limit; one accepted without a permit is dropped at once, which closes its fd;
//! - hyper's header read timeout (with a Tokio timer) runs whenever the connection waits for
//!   request headers: from its start and again after each answer on a keep-alive connection, so
//!   neither a silent socket nor a half-sent request line holds a permit longer than
//!   `header_read_timeout`, and a request body must arrive within the same bound (else the
//!   request fails and the connection is freed). Only HTTP/1 is spoken (no protocol sniffing that could wait without
//!   a timer);
//! - on shutdown the listener is closed first, every connection is told to finish its current
//!   answer and close, and `serve` returns once all permits are back or after
//!   `shutdown_timeout`, whichever comes first.

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tower_http::timeout::RequestBodyTimeoutLayer;

use crate::limits::EdgeLimits;
use crate::metrics;

/// How long the accept loop pauses after an accept error that is not about one connection
/// (e.g. out of file descriptors), so it does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Counters of one `serve` loop, shared with whoever holds a clone (tests, diagnostics).
#[derive(Debug, Clone, Default)]
pub struct EdgeStats {
    inner: Arc<StatsInner>,
}

#[derive(Debug, Default)]
struct StatsInner {
    live: AtomicUsize,
    peak: AtomicUsize,
    accepted: AtomicU64,
    rejected: AtomicU64,
    header_timeouts: AtomicU64,
}

impl EdgeStats {
    /// Connections being served now.
    pub fn live(&self) -> usize {
        self.inner.live.load(Ordering::SeqCst)
    }
    /// Most connections ever served at once.
    pub fn peak(&self) -> usize {
        self.inner.peak.load(Ordering::SeqCst)
    }
    /// Connections taken in and served.
    pub fn accepted(&self) -> u64 {
        self.inner.accepted.load(Ordering::SeqCst)
    }
    /// Connections closed at once for lack of a permit.
    pub fn rejected(&self) -> u64 {
        self.inner.rejected.load(Ordering::SeqCst)
    }
    /// Connections closed by the header read timeout.
    pub fn header_timeouts(&self) -> u64 {
        self.inner.header_timeouts.load(Ordering::SeqCst)
    }

    fn opened(&self) -> LiveGuard {
        let live = self.inner.live.fetch_add(1, Ordering::SeqCst) + 1;
        self.inner.peak.fetch_max(live, Ordering::SeqCst);
        self.inner.accepted.fetch_add(1, Ordering::SeqCst);
        metrics::connection_opened();
        LiveGuard(self.clone())
    }
}

/// One served connection; dropping it ends the count.
struct LiveGuard(EdgeStats);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.inner.live.fetch_sub(1, Ordering::SeqCst);
        metrics::connection_closed();
    }
}

/// Serves `app` on `listener` under `limits` until `shutdown` completes, then drains the
/// connections (see the module docs). Errors only if `limits` are invalid.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: EdgeLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    serve_with_stats(listener, app, limits, EdgeStats::default(), shutdown).await
}

/// [`serve`], counting into `stats`.
pub async fn serve_with_stats(
    listener: TcpListener,
    app: Router,
    limits: EdgeLimits,
    stats: EdgeStats,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    limits
        .check()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    metrics::describe();
    // A body that does not arrive within the same bound fails its request (and frees the
    // connection), so a client cannot hold a permit by trickling a body either.
    let app = app.layer(RequestBodyTimeoutLayer::new(limits.header_read_timeout));
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);

    loop {
        let stream = tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(e) => {
                    if !is_per_connection_error(&e) {
                        tracing::error!(error = %e, "accept failed");
                        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    }
                    continue;
                }
            },
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            stats.inner.rejected.fetch_add(1, Ordering::SeqCst);
            metrics::connection_rejected();
            tracing::debug!(
                limit = limits.max_connections,
                "connection over max_connections closed"
            );
            drop(stream);
            continue;
        };
        let live = stats.opened();
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let conn = builder
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()))
            .into_owned();
        let mut stop = stop_rx.clone();
        let stats = stats.clone();
        tokio::spawn(async move {
            let mut conn = std::pin::pin!(conn);
            let stopping = async move {
                // Also ends if `serve` has returned (the sender is gone).
                let _ = stop.wait_for(|stop| *stop).await;
            };
            let result = tokio::select! {
                result = conn.as_mut() => result,
                () = stopping => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = result {
                if is_header_timeout(&*e) {
                    stats.inner.header_timeouts.fetch_add(1, Ordering::SeqCst);
                    metrics::header_read_timed_out();
                    tracing::debug!("connection closed: request headers not received in time");
                } else {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
            }
            drop(live);
            drop(permit);
        });
    }

    drop(listener);
    let open = limits.max_connections - permits.available_permits();
    tracing::info!(open, "no longer accepting; draining connections");
    let _ = stop_tx.send(true);
    let all = u32::try_from(limits.max_connections).expect("checked by EdgeLimits::check");
    match tokio::time::timeout(limits.shutdown_timeout, permits.acquire_many(all)).await {
        Ok(_) => tracing::info!("every connection closed"),
        Err(_) => tracing::warn!(
            left = limits.max_connections - permits.available_permits(),
            after = ?limits.shutdown_timeout,
            "connections still open at the end of the shutdown timeout; dropping them"
        ),
    }
    Ok(())
}

/// Errors of `accept` that concern one connection only (the next accept may succeed at once).
fn is_per_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Whether a connection ended because hyper's header read timeout fired.
fn is_header_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(e);
    while let Some(e) = source {
        if let Some(hyper) = e.downcast_ref::<hyper::Error>() {
            if hyper.is_timeout() {
                return true;
            }
        }
        source = e.source();
    }
    false
}
