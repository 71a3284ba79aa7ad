//! Structured fuzzing of signed `kv_transfer_params`: a valid consumer params object (fields
//! from the input) is signed as a producer signs it ([`TransferAuth::sign_params`]), then edited
//! (keys set to arbitrary or slightly changed values, or removed), then checked by everything
//! that trusts a signature: [`TransferAuth::verify_params`], the consumer's
//! [`KvAdmission::check`], the producer's [`KvPeerService::claim`] / `release`, and
//! [`TransferRequest::parse`].
//!
//! Properties: the unedited params verify until `expires_at` and expire from then on, also after
//! a trip through JSON text; params edited in any signed field (a key of [`SIGNED_KEYS`] whose
//! value, absent counting as `null`, differs) or in their signature never verify, are never
//! admitted and never claim a lease; params edited only outside the signed keys still verify,
//! and then parse to the producer's own answer (or are refused, never reinterpreted).

#![no_main]

use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value};
use tandem_kv_connector::allowlist::ProducerAllowlist;
use tandem_kv_connector::auth::{
    unix_millis, TransferAuth, EXPIRES_AT_KEY, SIGNATURE_KEY, SIGNED_KEYS,
};
use tandem_kv_connector::params::{RemotePrefill, TransferRequest, MAX_HOST_LEN, MAX_ID_LEN};
use tandem_kv_connector::pull::{
    HandshakeProvider, KvAdmission, KvPeerService, LeaseTable, ReleaseOutcome,
};
use tandem_kv_connector::KvConnectorError;

const SECRET: &[u8] = b"fuzz-deployment-secret";
const BLOCK_SIZE: usize = 16;

/// The fields of the producer's answer, before they are made valid.
#[derive(Arbitrary, Debug)]
struct Base {
    engine_id: String,
    request_id: String,
    block_ids: Vec<u32>,
    host: String,
    port: u16,
    checksums: Option<String>,
    ttl_ms: u16,
    /// When the consumer checks, in ms after signing.
    check_after_ms: u32,
}

#[derive(Arbitrary, Debug)]
enum Key {
    /// `SIGNED_KEYS[i % len]`.
    Signed(u8),
    Signature,
    DoRemoteDecode,
    Other(String),
}

#[derive(Arbitrary, Debug)]
enum NewValue {
    Null,
    Bool(bool),
    U64(u64),
    I64(i64),
    F64(f64),
    Str(String),
    Ids(Vec<u32>),
    Object(Vec<(String, u64)>),
    /// A small change of the current value.
    Tweak(u8),
}

#[derive(Arbitrary, Debug)]
enum Edit {
    Set(Key, NewValue),
    Remove(Key),
}

#[derive(Arbitrary, Debug)]
struct Input {
    base: Base,
    edits: Vec<Edit>,
}

fn id(s: &str, fallback: &str) -> String {
    let mut out = String::new();
    for c in s.chars().filter(|c| !c.is_control()) {
        if out.len() + c.len_utf8() > MAX_ID_LEN {
            break;
        }
        out.push(c);
    }
    if out.is_empty() {
        fallback.into()
    } else {
        out
    }
}

fn host(s: &str) -> String {
    let out: String = s
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':' | '%'))
        .take(MAX_HOST_LEN)
        .collect();
    if out.is_empty() {
        "127.0.0.1".into()
    } else {
        out
    }
}

fn key_name(k: &Key) -> String {
    match k {
        Key::Signed(i) => SIGNED_KEYS[*i as usize % SIGNED_KEYS.len()].into(),
        Key::Signature => SIGNATURE_KEY.into(),
        Key::DoRemoteDecode => "do_remote_decode".into(),
        Key::Other(s) => s.clone(),
    }
}

fn tweak(old: Option<&Value>, k: u8) -> Value {
    match old {
        Some(Value::Bool(b)) => Value::Bool(!b),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(u) => Value::from(u.wrapping_add(1 + u64::from(k))),
            None => Value::from(k),
        },
        Some(Value::String(s)) => {
            let mut s = s.clone();
            if k.is_multiple_of(2) && !s.is_empty() {
                s.pop();
            } else {
                s.push(char::from(b'A' + k % 26));
            }
            Value::String(s)
        }
        Some(Value::Array(a)) => {
            let mut a = a.clone();
            match k % 3 {
                0 => a.reverse(),
                1 => a.push(Value::from(k)),
                _ => {
                    a.pop();
                }
            }
            Value::Array(a)
        }
        Some(Value::Object(_)) | Some(Value::Null) | None => Value::from(k),
    }
}

fn new_value(v: &NewValue, old: Option<&Value>) -> Value {
    match v {
        NewValue::Null => Value::Null,
        NewValue::Bool(b) => Value::Bool(*b),
        NewValue::U64(n) => Value::from(*n),
        NewValue::I64(n) => Value::from(*n),
        NewValue::F64(f) => Value::from(*f),
        NewValue::Str(s) => Value::String(s.clone()),
        NewValue::Ids(ids) => json!(ids),
        NewValue::Object(kv) => Value::Object(
            kv.iter()
                .map(|(k, n)| (k.clone(), Value::from(*n)))
                .collect(),
        ),
        NewValue::Tweak(k) => tweak(old, *k),
    }
}

/// The value a signature covers for `key` (absent reads as `null`).
fn covered<'a>(p: &'a Map<String, Value>, key: &str) -> &'a Value {
    p.get(key).unwrap_or(&Value::Null)
}

fuzz_target!(|input: Input| {
    let b = &input.base;
    let mut seen = std::collections::HashSet::new();
    let mut block_ids: Vec<u32> = b
        .block_ids
        .iter()
        .copied()
        // NULL_BLOCK (no block) is never a producer's block id
        .filter(|&i| i != tandem_kv_cache::NULL_BLOCK && seen.insert(i))
        .take(64)
        .collect();
    if block_ids.is_empty() {
        block_ids.push(0);
    }
    let remote = RemotePrefill {
        remote_engine_id: id(&b.engine_id, "p0"),
        remote_request_id: id(&b.request_id, "3-abc"),
        remote_block_ids: vec![block_ids],
        remote_host: host(&b.host),
        remote_port: b.port.max(1),
        tp_size: 1,
        remote_block_size: None,
    };
    let prompt_len = remote.remote_block_ids[0].len() * BLOCK_SIZE;
    let auth = TransferAuth::new(SECRET).expect("a long enough secret");
    let answer = |signed_at: u64, ttl: Duration| {
        let mut v = remote.to_value();
        if let Some(c) = &b.checksums {
            v["kv_checksums"] = Value::String(c.clone());
        }
        let Value::Object(mut p) = v else {
            unreachable!("to_value is an object")
        };
        assert_eq!(
            RemotePrefill::from_params(&Value::Object(p.clone())).ok(),
            Some(remote.clone())
        );
        auth.sign_params(&mut p, signed_at, ttl);
        p
    };

    // Unedited: valid until expiry, expired from then on, also after a trip through JSON text.
    let signed_at = 1_000_000u64;
    let ttl = u64::from(b.ttl_ms) + 1;
    let short = answer(signed_at, Duration::from_millis(ttl));
    let expires = signed_at + ttl;
    assert_eq!(
        short.get(EXPIRES_AT_KEY).and_then(Value::as_u64),
        Some(expires)
    );
    let at = signed_at + u64::from(b.check_after_ms);
    let text_trip: Map<String, Value> =
        serde_json::from_slice(&serde_json::to_vec(&short).expect("serializes")).expect("parses");
    for p in [&short, &text_trip] {
        match auth.verify_params(p, at) {
            Ok(()) => assert!(at < expires),
            Err(KvConnectorError::Expired(_)) => assert!(at >= expires),
            Err(e) => panic!("the producer's own params refused: {e}"),
        }
        auth.verify_params(p, signed_at).expect("valid when signed");
    }
    let other = TransferAuth::new(b"another-deployment-secret").expect("a long enough secret");
    assert!(
        other.verify_params(&short, signed_at).is_err(),
        "verified with another secret"
    );

    // Edited, on the real clock (the routes below read it), with an hour to go.
    let now = unix_millis();
    let base = answer(now, Duration::from_secs(3600));
    let mut edited = base.clone();
    for e in input.edits.iter().take(8) {
        match e {
            Edit::Set(k, v) => {
                let k = key_name(k);
                let v = new_value(v, edited.get(&k));
                edited.insert(k, v);
            }
            Edit::Remove(k) => {
                edited.remove(&key_name(k));
            }
        }
    }
    let signed_changed = SIGNED_KEYS
        .iter()
        .any(|k| covered(&base, k) != covered(&edited, k));
    let signature_changed = base.get(SIGNATURE_KEY) != edited.get(SIGNATURE_KEY);
    let should_verify = !signed_changed && !signature_changed;
    let edited_text: Map<String, Value> =
        serde_json::from_slice(&serde_json::to_vec(&edited).expect("serializes")).expect("parses");
    for p in [&edited, &edited_text] {
        let verdict = auth.verify_params(p, now);
        assert_eq!(
            verdict.is_ok(),
            should_verify,
            "signed fields changed: {signed_changed}, signature changed: {signature_changed}, \
             verdict: {verdict:?}, params: {p:?}"
        );
    }
    let edited = Value::Object(edited);

    // What a verified object means: the producer's answer, or a refusal.
    if should_verify {
        match TransferRequest::parse(Some(&edited), prompt_len, BLOCK_SIZE) {
            Ok(TransferRequest::Consumer(r)) => assert_eq!(r, remote),
            Ok(other) => panic!("signed consumer params parsed as {other:?}"),
            // `do_remote_decode` is outside the signature: edited (to `true`, or to something
            // not a boolean), it can only make the request a refused one.
            Err(e) => {
                assert!(
                    matches!(e, KvConnectorError::InvalidTransferParams(_)),
                    "{e:?}"
                );
                assert_ne!(
                    edited.get("do_remote_decode"),
                    base.get("do_remote_decode"),
                    "signed params refused: {e}"
                );
            }
        }
    }
    let live_edited = edited;

    let admission = KvAdmission::new(Some(auth.clone()), ProducerAllowlist::any());
    let consumer = live_edited.get("do_remote_prefill") == Some(&Value::Bool(true));
    match admission.check(Some(&live_edited)) {
        Ok(()) => assert!(!consumer || should_verify, "edited params admitted"),
        Err(e) => assert!(consumer && !should_verify, "signed params refused: {e}"),
    }

    let leases = LeaseTable::new();
    leases.issue(
        &remote.remote_request_id,
        &remote.remote_block_ids,
        prompt_len,
        Instant::now() + Duration::from_secs(3600),
    );
    let service = KvPeerService::new(
        remote.remote_engine_id.clone(),
        HandshakeProvider::new(),
        leases,
        Some(auth),
    );
    let body = json!({ "kv_transfer_params": live_edited });
    match service.claim(&body) {
        Ok(()) => {
            assert!(should_verify, "edited params claimed a lease");
            assert!(
                service.claim(&body).is_err(),
                "a replayed claim was granted"
            );
            assert_eq!(service.release(&body).ok(), Some(ReleaseOutcome::Claimed));
        }
        Err(e) => {
            assert!(!should_verify, "the producer refused its own params: {e}");
            assert!(
                service.release(&body).is_err(),
                "edited params released a lease"
            );
        }
    }
});
