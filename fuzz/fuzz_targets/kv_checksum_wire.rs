//! Fuzzes the KV checksum wire decoder (`tandem_kv_checksum::wire`) on hostile bytes: the
//! input is tried both as the base64 string of `kv_transfer_params["kv_checksums"]`
//! ([`Payload::decode`]) and as raw msgpack ([`Payload::from_msgpack`], what push carriers use).
//!
//! Properties: decoding never panics; a failure is `Malformed` or `Version`; a decoded payload
//! has the invariants of the wire module's docs (tp_size > 0, positive block sizes, distinct group
//! ids, positions whose tokens fit in `u64`), and encoding it decodes to the same payload.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_kv_checksum::{Payload, UnverifiedReason};

fn check(decoded: Result<Payload, UnverifiedReason>) {
    let p = match decoded {
        Ok(p) => p,
        Err(UnverifiedReason::Malformed | UnverifiedReason::Version) => return,
        Err(other) => panic!("decode failed with {other:?}, not Malformed or Version"),
    };
    assert!(p.tp_size > 0, "decoded tp_size 0");
    let mut ids: Vec<usize> = p.groups.iter().map(|g| g.group_id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), p.groups.len(), "duplicate group ids in {p:?}");
    for g in &p.groups {
        assert!(g.block_size > 0, "block size 0 in {p:?}");
        let end = g.start.checked_add(g.values.len());
        let end_token = end.and_then(|e| e.checked_mul(g.block_size));
        assert!(
            end_token.is_some(),
            "group {} overflows u64 tokens",
            g.group_id
        );
        assert!(u64::try_from(end_token.unwrap_or(0)).is_ok());
    }
    let text = p.encode().expect("a decoded payload encodes");
    assert_eq!(
        Payload::decode(&text).as_ref(),
        Ok(&p),
        "decode(encode(x)) != x"
    );
    let bytes = p.to_msgpack().expect("a decoded payload encodes");
    assert_eq!(Payload::from_msgpack(&bytes).as_ref(), Ok(&p));
}

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        check(Payload::decode(s));
    }
    check(Payload::from_msgpack(data));
});
