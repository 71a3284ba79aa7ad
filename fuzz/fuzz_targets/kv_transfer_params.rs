//! Fuzzes everything that reads a request's `kv_transfer_params`, on arbitrary JSON bytes
//! (parsed with `serde_json::from_slice` first, as the server does):
//! [`TransferRequest::parse`], [`RemotePrefill::from_params`], the consumer's
//! [`KvAdmission::check`], the producer's [`KvPeerService`] claim and release routes, and
//! [`TransferAuth::verify_params`] / [`TransferAuth::verify_request`].
//!
//! Properties: nothing panics; a parsed [`RemotePrefill`] has every invariant of `params.rs`'s
//! module docs (block count `cdiv(prompt_len, block_size)` and distinct ids, ids of 1 to
//! `MAX_ID_LEN` bytes without control characters, a plain host, port 1..=65535, tp_size 1) and
//! parses back from its own `to_value`; no fuzzed input carries a valid signature, so a service
//! with a secret refuses every claim and release, and an open service grants a claim only for the
//! exact lease it issued, once.

#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};
use tandem_kv_cache::NULL_BLOCK;
use tandem_kv_connector::allowlist::ProducerAllowlist;
use tandem_kv_connector::auth::TransferAuth;
use tandem_kv_connector::params::{
    RemotePrefill, TransferRequest, MAX_BLOCK_IDS, MAX_ID_LEN, MAX_KV_GROUPS, MAX_TP_SIZE,
};
use tandem_kv_connector::pull::{
    HandshakeProvider, KvAdmission, KvPeerService, LeaseTable, ReleaseOutcome, HANDSHAKE_PATH,
};
use tandem_kv_connector::KvConnectorError;

const SECRET: &[u8] = b"fuzz-deployment-secret";
const ENGINE: &str = "p0";
const LEASE: &str = "3-abc";
const LEASE_BLOCKS: [u32; 2] = [5, 6];

fn valid_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_ID_LEN && !s.chars().any(char::is_control)
}

fn valid_host(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 253
        && h.chars().all(|c| {
            c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':' | '[' | ']' | '%')
        })
}

/// The invariants every parsed [`RemotePrefill`] has, whether or not the prompt is known.
fn assert_invariants(r: &RemotePrefill) {
    assert!(valid_id(&r.remote_engine_id), "{r:?}");
    assert!(valid_id(&r.remote_request_id), "{r:?}");
    assert!(valid_host(&r.remote_host), "{r:?}");
    assert!(r.remote_port >= 1, "{r:?}");
    assert!((1..=MAX_TP_SIZE).contains(&r.tp_size), "{r:?}");
    assert!(
        (1..=MAX_KV_GROUPS).contains(&r.remote_block_ids.len()),
        "{r:?}"
    );
    for table in &r.remote_block_ids {
        assert!((1..=MAX_BLOCK_IDS).contains(&table.len()), "{r:?}");
        // nulls (before a sliding window) lead; blocks are distinct within a table
        let first = table
            .iter()
            .position(|&b| b != NULL_BLOCK)
            .expect("a table holds a block");
        assert!(table[first..].iter().all(|&b| b != NULL_BLOCK), "{r:?}");
        let mut ids = table[first..].to_vec();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), table.len() - first, "repeated block ids");
    }
    // What a producer answers parses back to the same thing (a producer never answers an empty
    // block list: only a prompt of 0 tokens, which the engine refuses, parses to one).
    assert_eq!(
        RemotePrefill::from_params(&r.to_value()).as_ref().ok(),
        Some(r)
    );
}

fn check_parse(value: &Value, prompt_len: usize, block_size: usize) {
    match TransferRequest::parse(Some(value), prompt_len, block_size) {
        Ok(TransferRequest::Consumer(r)) => {
            let bs = r.remote_block_size.unwrap_or(block_size).max(1);
            for table in &r.remote_block_ids {
                assert_eq!(
                    table.len(),
                    prompt_len.div_ceil(bs),
                    "block count does not fit a prompt of {prompt_len} in blocks of {bs}"
                );
            }
            assert_invariants(&r);
            assert_eq!(
                TransferRequest::parse(Some(&r.to_value()), prompt_len, block_size).ok(),
                Some(TransferRequest::Consumer(r.clone()))
            );
        }
        Ok(TransferRequest::Producer) => {
            assert_eq!(value.get("do_remote_decode"), Some(&Value::Bool(true)));
        }
        Ok(TransferRequest::PushProducer { transfer_id }) => {
            assert!(valid_id(&transfer_id));
            assert_eq!(value.get("do_remote_decode"), Some(&Value::Bool(true)));
        }
        Ok(TransferRequest::PushConsumer(push)) => {
            assert!(valid_id(&push.transfer_id));
            assert!(valid_host(&push.remote_host));
            assert_eq!(value.get("do_remote_prefill"), Some(&Value::Bool(true)));
        }
        Ok(TransferRequest::Local) => {
            assert_ne!(value.get("do_remote_prefill"), Some(&Value::Bool(true)));
            assert_ne!(value.get("do_remote_decode"), Some(&Value::Bool(true)));
        }
        Err(e) => assert!(
            matches!(e, KvConnectorError::InvalidTransferParams(_)),
            "{e:?}"
        ),
    }
}

fn service(auth: Option<TransferAuth>) -> (KvPeerService, LeaseTable) {
    let leases = LeaseTable::new();
    leases.issue(
        LEASE,
        &[LEASE_BLOCKS.to_vec()],
        LEASE_BLOCKS.len() * 16,
        std::time::Instant::now() + std::time::Duration::from_secs(3600),
    );
    let s = KvPeerService::new(
        ENGINE.into(),
        HandshakeProvider::new(),
        leases.clone(),
        auth,
    );
    (s, leases)
}

/// Whether `params` name exactly the lease the test service issued.
fn names_the_lease(params: Option<&Value>) -> bool {
    params
        .and_then(|p| RemotePrefill::from_params(p).ok())
        .is_some_and(|r| {
            r.remote_engine_id == ENGINE
                && r.remote_request_id == LEASE
                && r.remote_block_ids == [LEASE_BLOCKS.to_vec()]
        })
}

fn check_services(body: &Value) {
    let auth = TransferAuth::new(SECRET).expect("a long enough secret");
    let params = body.get("kv_transfer_params");

    // With a secret nothing unsigned, forged or edited gets through.
    let (signed, leases) = service(Some(auth.clone()));
    assert!(signed.claim(body).is_err(), "claim without a signature");
    assert!(signed.release(body).is_err(), "release without a signature");
    assert_eq!(leases.len(), 1);
    if let Some(Value::Object(obj)) = params {
        assert!(
            auth.verify_params(obj, 0).is_err(),
            "a fuzzed signature verified"
        );
    }

    // Without one, the lease decides: only its exact id and blocks, and a claim only once.
    let (open, _) = service(None);
    let ours = names_the_lease(params);
    match open.release(body) {
        Ok(ReleaseOutcome::Released) => assert!(ours, "released another lease"),
        Ok(ReleaseOutcome::Claimed) => panic!("claimed before any claim"),
        Ok(ReleaseOutcome::Unknown) => assert!(!ours),
        Err(_) => assert!(!ours, "release refused for the lease's own params"),
    }
    let (open, _) = service(None);
    match open.claim(body) {
        Ok(()) => {
            assert!(ours, "claim granted for params of another lease");
            assert!(open.claim(body).is_err(), "a replayed claim was granted");
            assert_eq!(open.release(body).ok(), Some(ReleaseOutcome::Claimed));
        }
        Err(_) => assert!(!ours, "claim refused for the lease's own params"),
    }
}

fn check_admission(value: &Value) {
    let auth = TransferAuth::new(SECRET).expect("a long enough secret");
    let wants_prefill = value.get("do_remote_prefill") == Some(&Value::Bool(true));
    // Push consumer params (with a `transfer_id`) come from the proxy unsigned by design: the
    // consumer only offers its own blocks for the producer's WRITE; their address is checked.
    let push = value.get("transfer_id").is_some_and(|t| !t.is_null());
    let signed = KvAdmission::new(Some(auth), ProducerAllowlist::any());
    match signed.check(Some(value)) {
        Ok(()) if push && wants_prefill => assert!(matches!(
            TransferRequest::parse(Some(value), 0, 1),
            Ok(TransferRequest::PushConsumer(_))
        )),
        Ok(()) => assert!(!wants_prefill, "unsigned do_remote_prefill params admitted"),
        Err(e) => assert!(wants_prefill, "non-consumer params refused: {e}"),
    }
    let open = KvAdmission::new(None, ProducerAllowlist::loopback());
    if open.check(Some(value)).is_ok() && wants_prefill && !push {
        let r = RemotePrefill::from_params(value).expect("admitted params parse");
        assert_invariants(&r);
    }
}

fuzz_target!(|data: &[u8]| {
    // The peer auth header is a string from the network too: no fuzzed one verifies.
    if let Ok(header) = std::str::from_utf8(data) {
        let auth = TransferAuth::new(SECRET).expect("a long enough secret");
        assert!(auth
            .verify_request("GET", HANDSHAKE_PATH, Some(header))
            .is_err());
    }
    let Ok(value) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    // A block size from 1 to 64 and a prompt that fits the block list, when there is one,
    // so that the consumer path is reached; then sizes at the edges.
    let block_size = 1 + data.len() % 64;
    // the flat list's length, or the first group's where there is one list per group
    let ids = value.get("remote_block_ids").and_then(Value::as_array);
    let n = ids
        .map(|a| a.first().and_then(Value::as_array).unwrap_or(a))
        .map_or(1, |a| a.len().max(1));
    let fitting = (n - 1) * block_size + 1 + data.first().map_or(0, |&b| b as usize) % block_size;
    for (prompt_len, bs) in [
        (fitting, block_size),
        (0, 0),
        (1, 0),
        (usize::MAX, 1),
        (usize::MAX, usize::MAX),
        (usize::MAX - 1, 2),
    ] {
        check_parse(&value, prompt_len, bs);
    }
    check_parse(&Value::Null, 0, 0);

    if let Ok(r) = RemotePrefill::from_params(&value) {
        assert_invariants(&r);
        assert_eq!(value.get("do_remote_prefill"), Some(&Value::Bool(true)));
    }
    check_admission(&value);
    // The claim and release bodies: the value as a body, and the value as its params.
    check_services(&value);
    check_services(&json!({ "kv_transfer_params": value }));
});
