//! The JSON rewrites of a P/D request: the client's body, the prefill copy, the decode body, and
//! reading `kv_transfer_params` from the prefill answer.
//!
//! Invariants: a client's `kv_transfer_params` never reaches an upstream (it is removed on parse);
//! the prefill copy asks for exactly one token, not streamed, with `{"do_remote_decode": true}`
//! (plus `decode_max_tokens`, the client's output limit, when it set one, which the producer
//! checks against the prompt before prefilling);
//! the decode body is the client's body unchanged except for the producer's `kv_transfer_params`,
//! which are forwarded as the producer wrote them (every key, known or not). What can be checked
//! without the model (`validate_client_body`: the token limits) is checked before any upstream
//! call, so a request that cannot be decoded never costs a prefill.

use axum::http::HeaderName;
use serde_json::{json, Map, Value};

use crate::error::ProxyError;

/// The header that names a request across the proxy and both instances.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The key that carries the P/D handshake in request and response bodies.
pub const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// A client's completion request: a JSON object without `kv_transfer_params`.
pub(crate) type ClientBody = Map<String, Value>;

/// Parses the client's body; anything but a JSON object is the client's mistake.
/// Removes any `kv_transfer_params` the client sent: the proxy never trusts them.
pub(crate) fn parse_client_body(bytes: &[u8]) -> Result<ClientBody, ProxyError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| ProxyError::InvalidBody {
        message: format!("not valid JSON: {e}"),
    })?;
    let Value::Object(mut body) = value else {
        return Err(ProxyError::InvalidBody {
            message: "expected a JSON object".to_owned(),
        });
    };
    if body.remove(KV_TRANSFER_PARAMS).is_some() {
        tracing::debug!("dropped kv_transfer_params sent by the client");
    }
    Ok(body)
}

/// The token-limit fields: absent or `null` is fine, anything else must be an integer ≥ 1.
const TOKEN_LIMIT_FIELDS: [&str; 2] = ["max_tokens", "max_completion_tokens"];

/// Checks what needs no model: `max_tokens` / `max_completion_tokens`, when present and not
/// null, are integers of at least 1 (the decode instance must have a token to generate).
pub(crate) fn validate_client_body(body: &ClientBody) -> Result<(), ProxyError> {
    for param in TOKEN_LIMIT_FIELDS {
        let message = match body.get(param) {
            None | Some(Value::Null) => continue,
            Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n >= 1) => continue,
            Some(Value::Number(n)) if n.is_i64() || n.is_u64() => "must be at least 1",
            Some(_) => "must be an integer",
        };
        return Err(ProxyError::InvalidParam {
            param,
            message: message.to_owned(),
        });
    }
    Ok(())
}

/// The copy sent to the prefill instance: one token, not streamed, one choice, asking the
/// producer to keep the KV for a remote decode.
pub(crate) fn prefill_body(client: &ClientBody) -> ClientBody {
    let mut body = client.clone();
    body.insert("max_tokens".into(), json!(1));
    if body.contains_key("max_completion_tokens") {
        body.insert("max_completion_tokens".into(), json!(1));
    }
    body.insert("stream".into(), json!(false));
    body.remove("stream_options");
    // One token of one choice is all the producer has to make; keys that would contradict
    // that (`min_tokens` > 1, `best_of` > 1) go too.
    if body.contains_key("n") {
        body.insert("n".into(), json!(1));
    }
    body.remove("best_of");
    body.remove("min_tokens");
    // The producer checks the prompt against the decode's output limit before it prefills, so a
    // request the decode instance would refuse costs no prefill.
    let mut params = json!({ "do_remote_decode": true });
    let limit = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| client.get(*k).filter(|v| !v.is_null()));
    if let Some(n) = limit {
        params[DECODE_MAX_TOKENS] = n.clone();
    }
    body.insert(KV_TRANSFER_PARAMS.into(), params);
    body
}

/// The `kv_transfer_params` key of a prefill copy that carries the client's output limit.
pub(crate) const DECODE_MAX_TOKENS: &str = "decode_max_tokens";

/// The body sent to the decode instance: the client's request with the producer's
/// `kv_transfer_params`.
pub(crate) fn decode_body(
    mut client: ClientBody,
    kv_transfer_params: Map<String, Value>,
) -> ClientBody {
    client.insert(KV_TRANSFER_PARAMS.into(), Value::Object(kv_transfer_params));
    client
}

/// Why a prefill answer yields no `kv_transfer_params`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum KvParamsError {
    /// The answer is not a JSON object.
    NotJson(String),
    /// The answer has no `kv_transfer_params` object (absent, null or another type).
    Missing,
}

/// Takes `kv_transfer_params` out of a successful prefill answer, untouched.
pub(crate) fn kv_transfer_params(
    prefill_answer: &[u8],
) -> Result<Map<String, Value>, KvParamsError> {
    let value: Value = serde_json::from_slice(prefill_answer)
        .map_err(|e| KvParamsError::NotJson(e.to_string()))?;
    let Value::Object(mut answer) = value else {
        return Err(KvParamsError::NotJson("not a JSON object".to_owned()));
    };
    match answer.remove(KV_TRANSFER_PARAMS) {
        Some(Value::Object(params)) => Ok(params),
        _ => Err(KvParamsError::Missing),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> ClientBody {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn client_params_are_stripped_and_non_objects_rejected() {
        let body = parse_client_body(
            br#"{"prompt":"hi","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"evil"}}"#,
        )
        .unwrap();
        assert_eq!(Value::Object(body), json!({"prompt": "hi"}));
        assert!(matches!(
            parse_client_body(b"{not json"),
            Err(ProxyError::InvalidBody { .. })
        ));
        assert!(matches!(
            parse_client_body(b"[1,2]"),
            Err(ProxyError::InvalidBody { .. })
        ));
    }

    #[test]
    fn token_limits_must_be_integers_of_at_least_one() {
        for ok in [
            json!({}),
            json!({"max_tokens": 1}),
            json!({"max_tokens": null, "max_completion_tokens": 4096}),
        ] {
            assert!(validate_client_body(&obj(ok.clone())).is_ok(), "{ok}");
        }
        for (bad, field) in [
            (json!({"max_tokens": 0}), "max_tokens"),
            (json!({"max_tokens": -3}), "max_tokens"),
            (json!({"max_tokens": 2.5}), "max_tokens"),
            (json!({"max_tokens": "10"}), "max_tokens"),
            (
                json!({"max_tokens": 5, "max_completion_tokens": 0}),
                "max_completion_tokens",
            ),
            (
                json!({"max_completion_tokens": [1]}),
                "max_completion_tokens",
            ),
        ] {
            match validate_client_body(&obj(bad.clone())) {
                Err(ProxyError::InvalidParam { param, .. }) => assert_eq!(param, field, "{bad}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn prefill_copy_asks_for_one_unstreamed_token() {
        let client = obj(json!({
            "model": "m", "messages": [], "stream": true, "stream_options": {"include_usage": true},
            "max_tokens": 50, "max_completion_tokens": 50, "n": 3, "best_of": 4, "min_tokens": 5,
            "temperature": 0.0
        }));
        let p = Value::Object(prefill_body(&client));
        assert_eq!(
            p,
            json!({
                "model": "m", "messages": [], "stream": false, "max_tokens": 1,
                "max_completion_tokens": 1, "n": 1, "temperature": 0.0,
                "kv_transfer_params": {"do_remote_decode": true, "decode_max_tokens": 50}
            })
        );
        let bare = Value::Object(prefill_body(&obj(json!({"prompt": "x"}))));
        assert_eq!(
            bare,
            json!({"prompt": "x", "max_tokens": 1, "stream": false,
                   "kv_transfer_params": {"do_remote_decode": true}})
        );
    }

    #[test]
    fn decode_body_carries_producer_params_untouched() {
        let client = obj(json!({"prompt": "x", "stream": true, "max_tokens": 9}));
        let params = obj(
            json!({"do_remote_prefill": true, "remote_block_ids": [1, 2], "kv_checksums": "AAE=", "future_key": {"a": null}}),
        );
        let d = Value::Object(decode_body(client, params.clone()));
        assert_eq!(
            d,
            json!({"prompt": "x", "stream": true, "max_tokens": 9, "kv_transfer_params": Value::Object(params)})
        );
    }

    #[test]
    fn reads_params_from_prefill_answer() {
        let ok = kv_transfer_params(br#"{"id":"1","kv_transfer_params":{"remote_engine_id":"e"}}"#);
        assert_eq!(Value::Object(ok.unwrap()), json!({"remote_engine_id": "e"}));
        assert_eq!(
            kv_transfer_params(br#"{"id":"1"}"#),
            Err(KvParamsError::Missing)
        );
        assert_eq!(
            kv_transfer_params(br#"{"kv_transfer_params":null}"#),
            Err(KvParamsError::Missing)
        );
        assert!(matches!(
            kv_transfer_params(b"<html>"),
            Err(KvParamsError::NotJson(_))
        ));
    }
}
