//! A JSON body extractor whose every rejection is an OpenAI error envelope.
//!
//! Invariant: a body that is too large is 413; one that is not JSON, or JSON of the wrong shape, is
//! 400 (vLLM's status), the latter with `param` naming the field as the client wrote it
//! (`max_tokens`, `messages[0].content`) and a message in JSON's terms, not Rust's; nothing about
//! a body can panic a handler.

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
        match serde_path_to_error::deserialize::<_, T>(&value) {
            Ok(v) => Ok(ApiJson(v)),
            Err(e) => {
                let mut path = e.path().to_string();
                let what = in_json_terms(&e.into_inner().to_string());
                if path == "." {
                    // Fields of a flattened struct lose their path: find the field alone.
                    path = culprit_field::<T>(&value, bytes.len()).unwrap_or(path);
                }
                Err(if path == "." {
                    ApiError::bad_request(None, format!("invalid request: {what}"))
                } else {
                    ApiError::bad_request(Some(&path), format!("{path}: {what}"))
                })
            }
        }
    }
}

/// Bodies up to this size, with at most [`CULPRIT_MAX_FIELDS`] fields, have their bad field found
/// by elimination (each trial deserializes the body again, so the work stays bounded).
const CULPRIT_MAX_BYTES: usize = 64 * 1024;
const CULPRIT_MAX_FIELDS: usize = 64;

/// The one field without which the body deserializes as `T`, if there is one.
fn culprit_field<T: DeserializeOwned>(
    value: &serde_json::Value,
    body_len: usize,
) -> Option<String> {
    let obj = value.as_object()?;
    if body_len > CULPRIT_MAX_BYTES || obj.len() > CULPRIT_MAX_FIELDS {
        return None;
    }
    obj.keys()
        .find(|key| {
            let mut without = obj.clone();
            without.remove(key.as_str());
            serde_json::from_value::<T>(serde_json::Value::Object(without)).is_ok()
        })
        .cloned()
}

/// serde's message with Rust's type names said in JSON's words.
fn in_json_terms(message: &str) -> String {
    let mut out = message.to_string();
    for (rust, json) in [
        ("expected usize", "expected a non-negative integer"),
        ("expected u64", "expected a non-negative integer"),
        ("expected u32", "expected a non-negative integer"),
        ("expected i64", "expected an integer"),
        ("expected i32", "expected an integer"),
        ("expected f32", "expected a number"),
        ("expected f64", "expected a number"),
        ("expected a boolean", "expected true or false"),
    ] {
        out = out.replace(rust, json);
    }
    if let Some(rest) = out.strip_prefix("data did not match any variant of untagged enum ") {
        let name = rest.split_whitespace().next().unwrap_or(rest);
        out = match name {
            "PromptInput" => {
                "expected a string, a list of strings, a list of token ids or a list of such \
                 lists"
                    .to_string()
            }
            "MessageContent" => "expected a string or a list of text parts".to_string(),
            "StringOrList" => "expected a string or a list of strings".to_string(),
            _ => "has a form this route does not take".to_string(),
        };
    }
    out
}
