//! The proxy's HTTP surface: the router, `/health`, `/metrics` and the fallbacks. The P/D routes
//! themselves live in `forward`.
//!
//! Invariants: every non-2xx answer built here is a `ProxyError` (so an OpenAI envelope), except
//! `/health`'s 503, which is the envelope with the instances' status added beside `error`, and
//! the 401 of the API-key check. With `--api-key` set, every route but [`OPEN_PATHS`] (unknown
//! paths included) needs `Authorization: Bearer <key>` (`tandem_http_edge::require_api_key`, the
//! proxy's one place for client authentication); the check runs before the body is read.

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::dashboard;
use crate::error::ProxyError;
use crate::forward;
use crate::pool::Role;
use crate::state::ProxyState;

/// Routes a client may call without the API key: probes, scrapes and the dashboard (which shows
/// what `/metrics` of the proxy and the instances already show).
pub const OPEN_PATHS: [&str; 4] = ["/health", "/metrics", "/dashboard", "/dashboard/summary"];

/// The proxy's router, ready to serve (drive it with `tower::ServiceExt::oneshot` or `axum::serve`).
///
/// Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
/// `GET /metrics`, `GET /dashboard` and `GET /dashboard/summary`; all but [`OPEN_PATHS`] behind the API key when one is configured.
pub fn app(state: ProxyState) -> Router {
    let limit = state.settings().max_body_bytes;
    let key = state.settings().api_key.as_ref().map(|k| k.shared());
    let router = Router::new()
        .route("/v1/completions", post(forward::completions))
        .route("/v1/chat/completions", post(forward::chat_completions))
        .route("/v1/models", get(forward::models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/dashboard", get(dashboard::page))
        .route("/dashboard/summary", get(dashboard::summary))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state);
    tandem_http_edge::require_api_key(router, key, &OPEN_PATHS)
}

/// `GET /health`: 200 with every instance's status while each role has a healthy instance,
/// else 503 with the OpenAI envelope plus the same status.
async fn health(State(state): State<ProxyState>) -> Response {
    let status = state.status();
    if status.is_ready() {
        return Json(json!({
            "status": "ok",
            "prefill": status.prefill,
            "decode": status.decode,
        }))
        .into_response();
    }
    let role = if status.prefill.iter().any(|i| i.healthy) {
        Role::Decode
    } else {
        Role::Prefill
    };
    let error = ProxyError::NoHealthyInstance { role };
    let mut body = error.envelope();
    body["prefill"] = json!(status.prefill);
    body["decode"] = json!(status.decode);
    (error.status(), Json(body)).into_response()
}

/// `GET /metrics`: the Prometheus text of the recorder whose handle the state holds.
async fn metrics(State(state): State<ProxyState>) -> Response {
    match state.prometheus() {
        Some(handle) => {
            handle.run_upkeep();
            (
                StatusCode::OK,
                [(
                    header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )],
                handle.render(),
            )
                .into_response()
        }
        None => ProxyError::MetricsDisabled.into_response(),
    }
}

async fn not_found(uri: Uri) -> ProxyError {
    ProxyError::NotFound {
        path: uri.path().to_owned(),
    }
}

async fn method_not_allowed() -> ProxyError {
    ProxyError::MethodNotAllowed
}
