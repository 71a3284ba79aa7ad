//! `ProxyError`: everything that can go wrong in the proxy, and its one mapping to HTTP.
//!
//! Invariants: `IntoResponse` is the only place an error becomes a status and a body. Client
//! bodies are the OpenAI envelope `{"error": {"message", "type", "param", "code"}}` and never
//! carry diagnostics (upstream URLs, I/O errors): those go to the log. The one exception is an
//! upstream's own OpenAI error ([`ProxyError::UpstreamErrorResponse`]), which is passed through
//! verbatim with the upstream's status. `code` doubles as the `outcome` label of the metrics.
//! A decode stream that breaks after its status was sent cannot get an error status any more;
//! [`mid_stream_error_event`] is the SSE event that ends it instead, in the instance server's
//! shape (`code` is the HTTP status as a number there).

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::pool::Role;

/// An error of the proxy: configuration, start-up, or one client request.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The configuration cannot be honoured.
    #[error("invalid proxy configuration: {0}")]
    Config(String),
    /// The listening socket could not be bound.
    #[error("could not listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    /// The global Prometheus recorder could not be installed.
    #[error("could not install the Prometheus recorder: {0}")]
    MetricsRecorder(String),
    /// The HTTP server stopped with an I/O error.
    #[error("proxy server failed: {0}")]
    Serve(std::io::Error),
    /// The client's body is not a JSON object.
    #[error("invalid request body: {message}")]
    InvalidBody { message: String },
    /// A field of the client's body has a value the request cannot be served with.
    #[error("invalid {param}: {message}")]
    InvalidParam {
        param: &'static str,
        message: String,
    },
    /// The client's body is larger than `max_body_bytes`.
    #[error("request body larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// Every instance of a role is out (failed health checks or connects).
    #[error("no healthy {role} instance")]
    NoHealthyInstance { role: Role },
    /// No TCP connection to the instance (nothing was sent).
    #[error("could not connect to {role} instance {url}: {source}")]
    UpstreamConnect {
        role: Role,
        url: String,
        source: reqwest::Error,
    },
    /// The instance did not answer within its timeout.
    #[error("{role} instance {url} did not answer within {after:?}")]
    UpstreamTimeout {
        role: Role,
        url: String,
        after: Duration,
    },
    /// The exchange with the instance failed after it was connected.
    #[error("request to {role} instance {url} failed: {source}")]
    UpstreamTransport {
        role: Role,
        url: String,
        source: reqwest::Error,
    },
    /// The instance answered an error status with an OpenAI error envelope: passed through.
    #[error("{role} instance {url} answered {status}")]
    UpstreamErrorResponse {
        role: Role,
        url: String,
        status: StatusCode,
        body: Bytes,
    },
    /// The instance answered an error status without an OpenAI error envelope.
    #[error("{role} instance {url} answered {status} without an OpenAI error body")]
    UpstreamStatus {
        role: Role,
        url: String,
        status: StatusCode,
    },
    /// The prefill instance's answer carries no `kv_transfer_params` object.
    #[error("prefill instance {url} answered without kv_transfer_params")]
    MissingKvTransferParams { url: String },
    /// The instance's answer is not what the protocol says (e.g. not JSON).
    #[error("{role} instance {url} sent an invalid response: {reason}")]
    InvalidUpstreamResponse {
        role: Role,
        url: String,
        reason: String,
    },
    /// No route for this path.
    #[error("no route for {path}")]
    NotFound { path: String },
    /// The route exists but not for this method.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// `/metrics` was asked for but no Prometheus handle was given.
    #[error("no Prometheus recorder installed")]
    MetricsDisabled,
}

impl ProxyError {
    /// The HTTP status the client gets.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidBody { .. } | Self::InvalidParam { .. } => StatusCode::BAD_REQUEST,
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::NotFound { .. } | Self::MetricsDisabled => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::NoHealthyInstance { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            Self::UpstreamErrorResponse { status, .. } => *status,
            Self::UpstreamConnect { .. }
            | Self::UpstreamTransport { .. }
            | Self::UpstreamStatus { .. }
            | Self::MissingKvTransferParams { .. }
            | Self::InvalidUpstreamResponse { .. } => StatusCode::BAD_GATEWAY,
            Self::Config(_) | Self::Bind { .. } | Self::MetricsRecorder(_) | Self::Serve(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// A stable machine-readable code: the envelope's `code` and the metrics' `outcome` label.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Config(_) | Self::Bind { .. } | Self::MetricsRecorder(_) | Self::Serve(_) => {
                "internal_error"
            }
            Self::InvalidBody { .. } => "invalid_body",
            Self::InvalidParam { .. } => "invalid_param",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::NoHealthyInstance { .. } => "no_healthy_instance",
            Self::UpstreamConnect { .. } => "upstream_unreachable",
            Self::UpstreamTimeout { .. } => "upstream_timeout",
            Self::UpstreamTransport { .. } => "upstream_transport_error",
            // The instance refused the client's request (a 4xx): the client's error, not a
            // failure of the upstream.
            Self::UpstreamErrorResponse { status, .. } if status.is_client_error() => {
                "client_error"
            }
            Self::UpstreamErrorResponse { .. } => "upstream_error",
            Self::UpstreamStatus { .. } => "upstream_bad_status",
            Self::MissingKvTransferParams { .. } => "missing_kv_transfer_params",
            Self::InvalidUpstreamResponse { .. } => "invalid_upstream_response",
            Self::NotFound { .. } | Self::MetricsDisabled => "not_found",
            Self::MethodNotAllowed => "method_not_allowed",
        }
    }

    /// The envelope's `type`.
    fn error_type(&self) -> &'static str {
        let status = self.status();
        match status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
            StatusCode::GATEWAY_TIMEOUT => "timeout_error",
            StatusCode::BAD_GATEWAY => "upstream_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The envelope's `message`: what the client may know, without upstream diagnostics.
    fn client_message(&self) -> String {
        match self {
            Self::InvalidBody { message } => format!("invalid request body: {message}"),
            Self::InvalidParam { param, message } => format!("invalid {param}: {message}"),
            Self::BodyTooLarge { limit } => {
                format!("request body larger than the limit of {limit} bytes")
            }
            Self::NoHealthyInstance { role } => format!("no healthy {role} instance available"),
            Self::UpstreamConnect { role, .. } => {
                format!("the {role} instance could not be reached")
            }
            Self::UpstreamTimeout { role, .. } => {
                format!("the {role} instance did not answer in time")
            }
            Self::UpstreamTransport { role, .. } => {
                format!("the request to the {role} instance failed")
            }
            Self::UpstreamStatus { role, status, .. } => {
                format!("the {role} instance failed with status {}", status.as_u16())
            }
            Self::MissingKvTransferParams { .. } => {
                "the prefill instance returned no kv_transfer_params (is it a kv_producer?)"
                    .to_owned()
            }
            Self::InvalidUpstreamResponse { role, .. } => {
                format!("the {role} instance sent an invalid response")
            }
            Self::NotFound { path } => format!("no route for {path}"),
            Self::MethodNotAllowed => "method not allowed".to_owned(),
            Self::MetricsDisabled => "metrics are not enabled on this proxy".to_owned(),
            Self::UpstreamErrorResponse { .. }
            | Self::Config(_)
            | Self::Bind { .. }
            | Self::MetricsRecorder(_)
            | Self::Serve(_) => "internal proxy error".to_owned(),
        }
    }

    /// The envelope's `param`: the client's field at fault, if one is.
    fn param(&self) -> Option<&'static str> {
        match self {
            Self::InvalidParam { param, .. } => Some(param),
            _ => None,
        }
    }

    /// The OpenAI error envelope for this error.
    pub fn envelope(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.client_message(),
                "type": self.error_type(),
                "param": self.param(),
                "code": self.code(),
            }
        })
    }
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(error = %self, "request failed");
        } else {
            tracing::debug!(error = %self, "request rejected");
        }
        let body = match self {
            Self::UpstreamErrorResponse { body, .. } => body,
            other => Bytes::from(other.envelope().to_string()),
        };
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }
}

/// The SSE event that ends a client's stream when its decode instance failed mid-stream, then
/// `data: [DONE]`. Same shape as the instance server's mid-stream error events; no diagnostics.
pub(crate) fn mid_stream_error_event() -> Bytes {
    let event = json!({
        "error": {
            "message": "the decode instance failed mid-stream; the answer is incomplete",
            "type": "upstream_error",
            "param": null,
            "code": StatusCode::BAD_GATEWAY.as_u16(),
        }
    });
    Bytes::from(format!("data: {event}\n\ndata: [DONE]\n\n"))
}

/// Whether `body` is an OpenAI error envelope: a JSON object whose `error` is an object with a
/// `message` (the shape a client library can parse).
pub(crate) fn is_openai_error(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("error")?.get("message").map(|m| m.is_string()))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_has_the_four_keys_and_no_diagnostics() {
        let err = ProxyError::UpstreamTimeout {
            role: Role::Prefill,
            url: "http://10.0.0.7:8100".into(),
            after: Duration::from_secs(3),
        };
        assert_eq!(err.status(), StatusCode::GATEWAY_TIMEOUT);
        let env = err.envelope();
        let inner = env["error"].as_object().unwrap();
        let mut keys: Vec<_> = inner.keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, ["code", "message", "param", "type"]);
        assert!(!env.to_string().contains("10.0.0.7"), "{env}");
    }

    #[test]
    fn invalid_param_names_the_field() {
        let err = ProxyError::InvalidParam {
            param: "max_tokens",
            message: "must be at least 1".into(),
        };
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        let env = err.envelope();
        assert_eq!(env["error"]["param"], "max_tokens");
        assert_eq!(env["error"]["code"], "invalid_param");
        assert!(env["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens"));
    }

    #[test]
    fn mid_stream_event_is_an_error_then_done() {
        let event = mid_stream_error_event();
        let text = std::str::from_utf8(&event).unwrap();
        let (first, rest) = text.split_once("\n\n").unwrap();
        assert_eq!(rest, "data: [DONE]\n\n");
        let value: serde_json::Value =
            serde_json::from_str(first.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(value["error"]["type"], "upstream_error");
        assert_eq!(value["error"]["code"], 502);
        assert!(value["error"]["message"]
            .as_str()
            .unwrap()
            .contains("failed mid-stream"));
    }

    #[test]
    fn an_upstream_4xx_is_the_clients_error_and_a_5xx_the_upstreams() {
        let answer = |status| ProxyError::UpstreamErrorResponse {
            role: Role::Decode,
            url: "http://d".into(),
            status,
            body: Bytes::from_static(br#"{"error":{"message":"x","type":"y"}}"#),
        };
        assert_eq!(answer(StatusCode::BAD_REQUEST).code(), "client_error");
        assert_eq!(answer(StatusCode::NOT_FOUND).code(), "client_error");
        assert_eq!(
            answer(StatusCode::INTERNAL_SERVER_ERROR).code(),
            "upstream_error"
        );
    }

    #[test]
    fn recognises_openai_errors() {
        assert!(is_openai_error(
            br#"{"error":{"message":"bad","type":"x"}}"#
        ));
        assert!(!is_openai_error(b"oops"));
        assert!(!is_openai_error(br#"{"error":"bad"}"#));
        assert!(!is_openai_error(br#"{"detail":"bad"}"#));
    }
}
