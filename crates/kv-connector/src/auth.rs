//! Who may move KV: the deployment secret, signed `kv_transfer_params`, and signed requests to a
//! producer's `/v1/kv/*` routes.
//!
//! Producer and consumer share one secret (`--kv-transfer-secret-file FILE`, or the secret itself
//! in `TANDEM_KV_TRANSFER_SECRET`). With it:
//! - a producer signs the `kv_transfer_params` it answers ([`TransferAuth::sign_params`]): it adds
//!   `expires_at` (Unix milliseconds: the end of the lease it issued) and `signature`, an
//!   HMAC-SHA256 over every key in [`SIGNED_KEYS`] (their JSON text, `null` when absent), so a
//!   changed engine id, host, port, block id, checksum or expiry breaks it;
//! - a consumer refuses params without a valid, unexpired signature before it connects anywhere
//!   ([`TransferAuth::verify_params`]);
//! - a consumer signs its handshake request to a producer ([`TransferAuth::sign_request`], the
//!   [`KV_AUTH_HEADER`] header: a timestamp and an HMAC over method, path and timestamp), and the
//!   producer answers only signed requests at most [`REQUEST_MAX_SKEW`] old: the handshake carries
//!   the NIXL metadata (memory keys) that a READ of its KV needs.
//!
//! Invariants: keys are at least [`MIN_SECRET_LEN`] bytes; MACs are compared in constant time;
//! nothing here logs or formats the secret ([`TransferAuth`]'s `Debug` hides it).

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use serde_json::{Map, Value};
use sha2::Sha256;

use crate::error::KvConnectorError;

/// The environment variable holding the secret itself (the file flag wins when both are set).
pub const SECRET_ENV: &str = "TANDEM_KV_TRANSFER_SECRET";
/// Shortest secret accepted.
pub const MIN_SECRET_LEN: usize = 16;
/// The `kv_transfer_params` keys a signature covers, in this order.
pub const SIGNED_KEYS: [&str; 9] = [
    "do_remote_prefill",
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "tp_size",
    "kv_checksums",
    EXPIRES_AT_KEY,
];
/// Key of the expiry (Unix milliseconds) in signed params.
pub const EXPIRES_AT_KEY: &str = "expires_at";
/// Key of the signature in signed params.
pub const SIGNATURE_KEY: &str = "signature";
/// Header of a signed request to a producer's `/v1/kv/*` routes: `{unix seconds}.{mac}`.
pub const KV_AUTH_HEADER: &str = "x-tandem-kv-auth";
/// How far a signed request's timestamp may be from the receiver's clock.
pub const REQUEST_MAX_SKEW: Duration = Duration::from_secs(60);

const PARAMS_DOMAIN: &[u8] = b"tandem/kv-transfer-params/v1";
const REQUEST_DOMAIN: &[u8] = b"tandem/kv-request/v1";

type HmacSha256 = Hmac<Sha256>;

/// The deployment secret, ready to sign and verify.
#[derive(Clone)]
pub struct TransferAuth {
    key: Vec<u8>,
}

impl PartialEq for TransferAuth {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl Eq for TransferAuth {}

impl std::fmt::Debug for TransferAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TransferAuth(<secret>)")
    }
}

fn refused(reason: impl Into<String>) -> KvConnectorError {
    KvConnectorError::Unauthorized(reason.into())
}

/// Milliseconds since the Unix epoch.
pub fn unix_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl TransferAuth {
    /// A secret from its bytes (surrounding whitespace, e.g. a file's newline, is trimmed).
    pub fn new(secret: &[u8]) -> Result<Self, KvConnectorError> {
        let key = secret.trim_ascii().to_vec();
        if key.len() < MIN_SECRET_LEN {
            return Err(KvConnectorError::InvalidConfig(format!(
                "the KV transfer secret must be at least {MIN_SECRET_LEN} bytes, got {}",
                key.len()
            )));
        }
        Ok(TransferAuth { key })
    }

    /// The secret from `file` if given, else from [`SECRET_ENV`]; `None` when neither is set.
    pub fn load(file: Option<&Path>) -> Result<Option<Self>, KvConnectorError> {
        if let Some(path) = file {
            let bytes = std::fs::read(path).map_err(|e| {
                KvConnectorError::InvalidConfig(format!(
                    "cannot read the KV transfer secret file {}: {e}",
                    path.display()
                ))
            })?;
            return Self::new(&bytes).map(Some);
        }
        match std::env::var_os(SECRET_ENV) {
            Some(v) if !v.is_empty() => Self::new(v.as_encoded_bytes()).map(Some),
            _ => Ok(None),
        }
    }

    fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.key).expect("HMAC takes keys of any length")
    }

    fn params_mac(&self, params: &Map<String, Value>) -> HmacSha256 {
        let mut mac = self.mac();
        mac.update(PARAMS_DOMAIN);
        for key in SIGNED_KEYS {
            let text = params.get(key).unwrap_or(&Value::Null).to_string();
            mac.update(&(key.len() as u64).to_le_bytes());
            mac.update(key.as_bytes());
            mac.update(&(text.len() as u64).to_le_bytes());
            mac.update(text.as_bytes());
        }
        mac
    }

    /// Adds `expires_at` (`now_ms + ttl`) and `signature` to a producer's answer.
    pub fn sign_params(&self, params: &mut Map<String, Value>, now_ms: u64, ttl: Duration) {
        let expires = now_ms.saturating_add(ttl.as_millis() as u64);
        params.insert(EXPIRES_AT_KEY.into(), Value::from(expires));
        params.remove(SIGNATURE_KEY);
        let tag = self.params_mac(params).finalize().into_bytes();
        params.insert(
            SIGNATURE_KEY.into(),
            Value::String(URL_SAFE_NO_PAD.encode(tag)),
        );
    }

    /// Checks that `params` carry a signature made with this secret over their current values,
    /// and that `expires_at` is after `now_ms`.
    pub fn verify_params(
        &self,
        params: &Map<String, Value>,
        now_ms: u64,
    ) -> Result<(), KvConnectorError> {
        let sig = match params.get(SIGNATURE_KEY) {
            None | Some(Value::Null) => {
                return Err(refused(
                    "kv_transfer_params are not signed (this instance requires params signed \
                     by a producer holding the deployment's KV transfer secret)",
                ))
            }
            Some(Value::String(s)) => s,
            Some(_) => return Err(refused("signature must be a string")),
        };
        let tag = URL_SAFE_NO_PAD
            .decode(sig)
            .map_err(|_| refused("signature is not base64url"))?;
        self.params_mac(params)
            .verify_slice(&tag)
            .map_err(|_| refused("signature does not match the params (edited or forged)"))?;
        let expires = params
            .get(EXPIRES_AT_KEY)
            .and_then(Value::as_u64)
            .ok_or_else(|| refused("expires_at is missing"))?;
        if expires <= now_ms {
            return Err(KvConnectorError::Expired(format!(
                "kv_transfer_params expired {} ms ago",
                now_ms - expires
            )));
        }
        Ok(())
    }

    fn request_mac(&self, method: &str, path: &str, unix_secs: u64) -> HmacSha256 {
        let mut mac = self.mac();
        mac.update(REQUEST_DOMAIN);
        for part in [method.as_bytes(), path.as_bytes()] {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac.update(&unix_secs.to_le_bytes());
        mac
    }

    /// The [`KV_AUTH_HEADER`] value for a request `method path` made now.
    pub fn sign_request(&self, method: &str, path: &str) -> String {
        let t = unix_millis() / 1000;
        let tag = self.request_mac(method, path, t).finalize().into_bytes();
        format!("{t}.{}", URL_SAFE_NO_PAD.encode(tag))
    }

    /// Checks a [`KV_AUTH_HEADER`] value for `method path` against the clock.
    pub fn verify_request(
        &self,
        method: &str,
        path: &str,
        header: Option<&str>,
    ) -> Result<(), KvConnectorError> {
        let header = header.ok_or_else(|| {
            refused(format!(
                "{KV_AUTH_HEADER} is missing: this producer answers only peers holding the \
                 deployment's KV transfer secret"
            ))
        })?;
        let (t, sig) = header
            .split_once('.')
            .ok_or_else(|| refused(format!("{KV_AUTH_HEADER} is malformed")))?;
        let t: u64 = t
            .parse()
            .map_err(|_| refused(format!("{KV_AUTH_HEADER} is malformed")))?;
        let tag = URL_SAFE_NO_PAD
            .decode(sig)
            .map_err(|_| refused(format!("{KV_AUTH_HEADER} is malformed")))?;
        self.request_mac(method, path, t)
            .verify_slice(&tag)
            .map_err(|_| refused(format!("{KV_AUTH_HEADER} does not match")))?;
        let now = unix_millis() / 1000;
        if now.abs_diff(t) > REQUEST_MAX_SKEW.as_secs() {
            return Err(refused(format!(
                "{KV_AUTH_HEADER} is {} s away from this host's clock (at most {} s allowed)",
                now.abs_diff(t),
                REQUEST_MAX_SKEW.as_secs()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn auth() -> TransferAuth {
        TransferAuth::new(b"0123456789abcdef-secret\n").unwrap()
    }

    fn params() -> Map<String, Value> {
        json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "p0",
               "remote_request_id": "7-abc", "remote_block_ids": [4, 9, 2],
               "remote_host": "10.0.0.1", "remote_port": 8100, "tp_size": 1,
               "kv_checksums": "AAAA"})
        .as_object()
        .unwrap()
        .clone()
    }

    #[test]
    fn short_secrets_are_refused() {
        assert!(TransferAuth::new(b"  short  ").is_err());
        assert!(TransferAuth::new(&[b'x'; MIN_SECRET_LEN]).is_ok());
        assert_eq!(format!("{:?}", auth()), "TransferAuth(<secret>)");
    }

    #[test]
    fn signed_params_verify_until_they_expire() {
        let a = auth();
        let mut p = params();
        a.sign_params(&mut p, 1_000, Duration::from_secs(30));
        assert_eq!(p[EXPIRES_AT_KEY], json!(31_000));
        a.verify_params(&p, 30_999).unwrap();
        // Through JSON text and back (what the proxy does) it still verifies.
        let back: Map<String, Value> =
            serde_json::from_str(&Value::Object(p.clone()).to_string()).expect("round trip");
        a.verify_params(&back, 2_000).unwrap();
        assert!(matches!(
            a.verify_params(&p, 31_000),
            Err(KvConnectorError::Expired(_))
        ));
    }

    #[test]
    fn any_edit_or_another_secret_breaks_the_signature() {
        let a = auth();
        let mut signed = params();
        a.sign_params(&mut signed, 1_000, Duration::from_secs(30));
        let edits: Vec<(&str, Value)> = vec![
            ("remote_block_ids", json!([4, 9, 3])),
            ("remote_block_ids", json!([9, 4, 2])),
            ("remote_engine_id", json!("p1")),
            ("remote_request_id", json!("7-abd")),
            ("remote_host", json!("10.0.0.2")),
            ("remote_port", json!(8101)),
            ("tp_size", json!(2)),
            ("kv_checksums", json!("AAAB")),
            ("kv_checksums", Value::Null),
            (EXPIRES_AT_KEY, json!(99_999_999)),
            ("do_remote_prefill", json!(false)),
            (SIGNATURE_KEY, json!("AAAA")),
            (SIGNATURE_KEY, json!("not base64!")),
            (SIGNATURE_KEY, json!(7)),
        ];
        for (key, value) in edits {
            let mut p = signed.clone();
            p.insert(key.into(), value.clone());
            let e = a.verify_params(&p, 2_000).unwrap_err();
            assert!(
                matches!(e, KvConnectorError::Unauthorized(_)),
                "{key}={value}: {e}"
            );
        }
        let mut p = signed.clone();
        p.remove("kv_checksums");
        assert!(a.verify_params(&p, 2_000).is_err());
        let other = TransferAuth::new(b"another-secret-of-16").unwrap();
        assert!(other.verify_params(&signed, 2_000).is_err());
        assert!(a.verify_params(&params(), 2_000).is_err());
    }

    #[test]
    fn signed_requests_are_bound_to_method_and_path() {
        let a = auth();
        let h = a.sign_request("GET", "/v1/kv/handshake");
        a.verify_request("GET", "/v1/kv/handshake", Some(&h))
            .unwrap();
        assert!(a
            .verify_request("POST", "/v1/kv/handshake", Some(&h))
            .is_err());
        assert!(a.verify_request("GET", "/v1/kv/claim", Some(&h)).is_err());
        assert!(a.verify_request("GET", "/v1/kv/handshake", None).is_err());
        for junk in ["", "x", "1.2", "12345.", ".abc"] {
            assert!(a
                .verify_request("GET", "/v1/kv/handshake", Some(junk))
                .is_err());
        }
        // A signature from long ago is refused even though its MAC is right.
        let old = unix_millis() / 1000 - 3600;
        let tag = a
            .request_mac("GET", "/v1/kv/handshake", old)
            .finalize()
            .into_bytes();
        let stale = format!("{old}.{}", URL_SAFE_NO_PAD.encode(tag));
        let e = a
            .verify_request("GET", "/v1/kv/handshake", Some(&stale))
            .unwrap_err();
        assert!(e.to_string().contains("away from this host's clock"), "{e}");
        let other = TransferAuth::new(b"another-secret-of-16").unwrap();
        assert!(other
            .verify_request("GET", "/v1/kv/handshake", Some(&h))
            .is_err());
    }
}
