//! The bearer API-key check in front of a router: `Authorization: Bearer <key>` on every request
//! but those to the open paths, else 401 with the OpenAI error envelope.
//!
//! Invariants: with no key configured the router is returned unchanged; with one, a request to
//! any path not listed in `open_paths` (unknown paths included, so a 404 reveals nothing) reaches
//! the router only with the right key; the comparison runs in constant time
//! (`limits::constant_time_eq`) and an empty key never matches; neither the expected nor the
//! presented key is logged or echoed.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde_json::json;

use crate::limits::constant_time_eq;
use crate::metrics;

/// Wraps `router` so that every request outside `open_paths` (exact paths, e.g. `/health`,
/// `/metrics`) must carry `Authorization: Bearer <key>`; a missing or wrong key is answered 401
/// with `{"error":{"message","type":"authentication_error","param":null,"code":"invalid_api_key"}}`
/// and `WWW-Authenticate: Bearer`. With `key` `None`, `router` is returned as is.
pub fn require_api_key<S>(
    router: Router<S>,
    key: Option<Arc<str>>,
    open_paths: &[&str],
) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    let Some(key) = key else {
        return router;
    };
    let open: Arc<[String]> = open_paths.iter().map(|p| (*p).to_owned()).collect();
    router.layer(axum::middleware::from_fn(
        move |request: Request, next: Next| {
            let (key, open) = (key.clone(), open.clone());
            async move {
                if open.iter().any(|p| p == request.uri().path()) {
                    return next.run(request).await;
                }
                match bearer_token(&request) {
                    Some(token) if !key.is_empty() && constant_time_eq(key.as_bytes(), token) => {
                        next.run(request).await
                    }
                    presented => {
                        tracing::debug!(
                            path = request.uri().path(),
                            key_sent = presented.is_some(),
                            "request rejected: missing or wrong API key"
                        );
                        metrics::unauthorized();
                        unauthorized(presented.is_some())
                    }
                }
            }
        },
    ))
}

/// The token of `Authorization: Bearer <token>` (the scheme is case-insensitive).
fn bearer_token(request: &Request) -> Option<&[u8]> {
    let value = request.headers().get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    Some(rest.trim_ascii())
}

/// The 401 envelope: `message` says whether a key was sent, never which.
pub fn unauthorized_envelope(key_sent: bool) -> serde_json::Value {
    let message = if key_sent {
        "invalid API key"
    } else {
        "missing API key: send the header `Authorization: Bearer <key>`"
    };
    json!({
        "error": {
            "message": message,
            "type": "authentication_error",
            "param": null,
            "code": "invalid_api_key",
        }
    })
}

fn unauthorized(key_sent: bool) -> Response {
    let mut response = (
        StatusCode::UNAUTHORIZED,
        Json(unauthorized_envelope(key_sent)),
    )
        .into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::routing::get;
    use tower::ServiceExt;

    use super::*;

    fn app(key: Option<&str>) -> Router {
        let router = Router::new()
            .route("/health", get(|| async { "ok" }))
            .route("/metrics", get(|| async { "m" }))
            .route("/v1/models", get(|| async { "models" }));
        require_api_key(router, key.map(Arc::from), &["/health", "/metrics"])
    }

    async fn call(app: Router, path: &str, auth: Option<&str>) -> (StatusCode, serde_json::Value) {
        let mut request = axum::http::Request::get(path);
        if let Some(auth) = auth {
            request = request.header(header::AUTHORIZATION, auth);
        }
        let response = app
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        if status == StatusCode::UNAUTHORIZED {
            assert_eq!(response.headers()[header::WWW_AUTHENTICATE], "Bearer");
        }
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let body = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        (status, body)
    }

    fn assert_401(status: StatusCode, body: &serde_json::Value) {
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(body["error"]["type"], "authentication_error");
        assert_eq!(body["error"]["code"], "invalid_api_key");
        assert!(body["error"]["param"].is_null());
        assert!(body["error"]["message"].is_string());
        assert!(!body.to_string().contains("sk-right"), "{body}");
    }

    #[tokio::test]
    async fn missing_or_wrong_key_is_401_and_the_right_one_passes() {
        let key = Some("sk-right");
        for auth in [
            None,
            Some("Bearer sk-wrong"),
            Some("Bearer sk-righ"),
            Some("Bearer sk-right2"),
            Some("Basic sk-right"),
            Some("sk-right"),
            Some("Bearer "),
        ] {
            let (status, body) = call(app(key), "/v1/models", auth).await;
            assert_401(status, &body);
        }
        for auth in ["Bearer sk-right", "bearer sk-right", "BEARER  sk-right "] {
            let (status, _) = call(app(key), "/v1/models", Some(auth)).await;
            assert_eq!(status, StatusCode::OK, "{auth:?}");
        }
    }

    #[tokio::test]
    async fn open_paths_stay_open_and_unknown_paths_need_the_key() {
        let key = Some("sk-right");
        assert_eq!(call(app(key), "/health", None).await.0, StatusCode::OK);
        assert_eq!(call(app(key), "/metrics", None).await.0, StatusCode::OK);
        let (status, body) = call(app(key), "/nope", None).await;
        assert_401(status, &body);
        let (status, _) = call(app(key), "/nope", Some("Bearer sk-right")).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn no_key_configured_leaves_the_router_open_and_an_empty_key_never_matches() {
        assert_eq!(call(app(None), "/v1/models", None).await.0, StatusCode::OK);
        let (status, body) = call(app(Some("")), "/v1/models", Some("Bearer ")).await;
        assert_401(status, &body);
    }
}
