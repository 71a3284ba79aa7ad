//! The HTTP edge's error type and its one mapping to status + OpenAI envelope.
//!
//! Invariant: every error a client sees goes through [`ApiError::into_response`]; server-side
//! details are logged, and the body says only what the client can act on.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use tandem_engine::EngineError;
use tandem_kv_connector::KvConnectorError;

/// An error answered to a client.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<String>,
    },
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("request body too large: {0}")]
    PayloadTooLarge(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Refused `kv_transfer_params` or KV peer requests (counted where they are refused).
    #[error(transparent)]
    KvTransfer(#[from] KvConnectorError),
}

impl ApiError {
    pub fn bad_request(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: param.map(str::to_string),
        }
    }

    fn status_type_param(&self) -> (StatusCode, &'static str, Option<String>) {
        match self {
            ApiError::BadRequest { param, .. } => {
                (StatusCode::BAD_REQUEST, "BadRequestError", param.clone())
            }
            ApiError::ModelNotFound(_) => {
                (StatusCode::NOT_FOUND, "NotFoundError", Some("model".into()))
            }
            ApiError::PayloadTooLarge(_) => {
                (StatusCode::PAYLOAD_TOO_LARGE, "BadRequestError", None)
            }
            ApiError::KvTransfer(e) => {
                let param = Some("kv_transfer_params".to_string());
                match e {
                    KvConnectorError::Unauthorized(_) => {
                        (StatusCode::UNAUTHORIZED, "AuthenticationError", param)
                    }
                    KvConnectorError::Expired(_) | KvConnectorError::ProducerNotAllowed(_) => {
                        (StatusCode::FORBIDDEN, "PermissionDeniedError", param)
                    }
                    KvConnectorError::LeaseRefused(_) => {
                        (StatusCode::CONFLICT, "ConflictError", param)
                    }
                    KvConnectorError::InvalidTransferParams(_) => {
                        (StatusCode::BAD_REQUEST, "BadRequestError", param)
                    }
                    _ => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "InternalServerError",
                        None,
                    ),
                }
            }
            ApiError::Engine(e) => match e {
                EngineError::InvalidParam { param, .. } => (
                    StatusCode::BAD_REQUEST,
                    "BadRequestError",
                    Some(param.clone()),
                ),
                EngineError::ContextLengthExceeded { .. }
                | EngineError::TooLargeForCache { .. } => (
                    StatusCode::BAD_REQUEST,
                    "BadRequestError",
                    Some("messages".into()),
                ),
                EngineError::InvalidTransferParams(_) => (
                    StatusCode::BAD_REQUEST,
                    "BadRequestError",
                    Some("kv_transfer_params".into()),
                ),
                EngineError::EngineDead => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ServiceUnavailableError",
                    None,
                ),
                EngineError::KvLoadFailed(_)
                | EngineError::Execution(_)
                | EngineError::InvalidConfig(_) => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalServerError",
                    None,
                ),
            },
        }
    }

    /// The status and the envelope body.
    pub fn parts(&self) -> (StatusCode, serde_json::Value) {
        let (status, kind, param) = self.status_type_param();
        let message = match self {
            // Server-side failures: the details go to the log, the client gets a stable message.
            ApiError::Engine(EngineError::Execution(detail)) => {
                tracing::error!("request failed: {detail}");
                "the model failed while processing this request".to_string()
            }
            other => other.to_string(),
        };
        let body = json!({
            "error": {
                "message": message,
                "type": kind,
                "param": param,
                "code": status.as_u16(),
            }
        });
        (status, body)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, body) = self.parts();
        (status, Json(body)).into_response()
    }
}
