//! A JSON body extractor whose every rejection is an OpenAI error envelope.
//!
//! Invariant: a body that is too large is 413, one that is not JSON is 400, JSON of the wrong shape
//! is 422; nothing about a body can panic a handler.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A JSON request body of type `T`.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge(e.body_text())
            } else {
                ApiError::bad_request(
                    None,
                    format!("cannot read the request body: {}", e.body_text()),
                )
            }
        })?;
        let value: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad_request(None, format!("the body is not valid JSON: {e}")))?;
        if !value.is_object() {
            return Err(ApiError::bad_request(
                None,
                "the body must be a JSON object",
            ));
        }
        serde_json::from_value(value)
            .map(ApiJson)
            .map_err(|e| ApiError::Unprocessable(format!("invalid request: {e}")))
    }
}
