//! Fuzzes the KV checksum wire format from the encoding side: an arbitrary [`Payload`] (sizes
//! small, arbitrary, or near `2^64`) is encoded and decoded again.
//!
//! Property: `decode(encode(x)) == x` for every payload that has the wire module's invariants
//! (tp_size > 0, positive block sizes, distinct group ids, `(start + len) * block_size` fits in
//! `u64`); any other payload decodes to `Malformed`, never to something else.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tandem_kv_checksum::{Payload, PayloadGroup, UnverifiedReason};

/// A size biased towards the edges a decoder must get right.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Size {
    Small(u8),
    Any(u64),
    /// `u64::MAX - n`.
    NearMax(u8),
}

impl Size {
    fn get(self) -> usize {
        let v = match self {
            Size::Small(n) => u64::from(n),
            Size::Any(n) => n,
            Size::NearMax(n) => u64::MAX - u64::from(n),
        };
        // usize is 64 bits on every target this project builds for.
        usize::try_from(v).unwrap_or(usize::MAX)
    }
}

#[derive(Arbitrary, Debug)]
struct Group {
    group_id: Size,
    fingerprint: u64,
    block_size: Size,
    start: Size,
    values: Vec<u64>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    tp_size: u32,
    num_tokens: Size,
    groups: Vec<Group>,
}

fn has_invariants(p: &Payload) -> bool {
    let mut ids: Vec<usize> = p.groups.iter().map(|g| g.group_id).collect();
    ids.sort_unstable();
    ids.dedup();
    p.tp_size > 0
        && ids.len() == p.groups.len()
        && p.groups.iter().all(|g| {
            g.block_size > 0
                && g.start
                    .checked_add(g.values.len())
                    .and_then(|e| e.checked_mul(g.block_size))
                    .is_some()
        })
}

fuzz_target!(|input: Input| {
    let payload = Payload {
        tp_size: input.tp_size,
        num_tokens: input.num_tokens.get(),
        groups: input
            .groups
            .into_iter()
            .map(|g| PayloadGroup {
                group_id: g.group_id.get(),
                fingerprint: g.fingerprint,
                block_size: g.block_size.get(),
                start: g.start.get(),
                values: g.values,
            })
            .collect(),
    };
    let text = payload.encode().expect("every payload encodes");
    let decoded = Payload::decode(&text);
    let from_bytes = Payload::from_msgpack(&payload.to_msgpack().expect("every payload encodes"));
    assert_eq!(decoded, from_bytes, "base64 and msgpack decoding disagree");
    if has_invariants(&payload) {
        assert_eq!(decoded, Ok(payload), "decode(encode(x)) != x");
    } else {
        assert_eq!(decoded, Err(UnverifiedReason::Malformed), "{payload:?}");
    }
});
