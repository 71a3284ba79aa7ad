//! The wire format: round trips, its size for a long prompt, and malformed input of every kind
//! (proptest over arbitrary bytes and strings, and mutations of valid payloads).

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use proptest::prelude::*;
use tandem_kv_checksum::*;

fn payload_strategy() -> impl Strategy<Value = Payload> {
    let group = (
        0usize..8,
        any::<u64>(),
        1usize..1024,
        0usize..1_000_000,
        prop::collection::vec(any::<u64>(), 0..64),
    )
        .prop_map(
            |(group_id, fingerprint, block_size, start, values)| PayloadGroup {
                group_id,
                fingerprint,
                block_size,
                start,
                values,
            },
        );
    (1u32..64, any::<u32>(), prop::collection::vec(group, 0..4)).prop_map(
        |(tp_size, num_tokens, mut groups)| {
            groups.sort_by_key(|g| g.group_id);
            groups.dedup_by_key(|g| g.group_id);
            Payload {
                tp_size,
                num_tokens: num_tokens as usize,
                groups,
            }
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn encode_then_decode_is_the_identity(p in payload_strategy()) {
        let s = p.encode().unwrap();
        prop_assert_eq!(Payload::decode(&s), Ok(p.clone()));
        prop_assert_eq!(Payload::from_msgpack(&p.to_msgpack().unwrap()), Ok(p));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = Payload::from_msgpack(&bytes);
        let _ = Payload::decode(&STANDARD.encode(&bytes));
    }

    #[test]
    fn arbitrary_strings_never_panic(s in ".{0,200}") {
        if let Err(r) = Payload::decode(&s) {
            prop_assert!(matches!(r, UnverifiedReason::Malformed | UnverifiedReason::Version));
        }
    }

    #[test]
    fn mutated_payloads_never_panic(
        p in payload_strategy(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let valid = p.to_msgpack().unwrap();
        let mut bytes = valid.clone();
        for (i, b) in edits {
            let i = i.index(bytes.len());
            bytes[i] = b;
        }
        let _ = Payload::from_msgpack(&bytes);
        let _ = Payload::decode(&STANDARD.encode(&bytes));
        // a truncated payload never decodes
        let cut = cut.index(valid.len());
        prop_assert_eq!(Payload::from_msgpack(&valid[..cut]), Err(UnverifiedReason::Malformed));
    }
}

fn raw<T: serde::Serialize>(v: &T) -> String {
    STANDARD.encode(rmp_serde::to_vec(v).unwrap())
}

struct Bin(Vec<u8>);
impl serde::Serialize for Bin {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

#[test]
fn the_format_is_the_documented_array() {
    let p = Payload {
        tp_size: 2,
        num_tokens: 20,
        groups: vec![PayloadGroup {
            group_id: 1,
            fingerprint: 0xdead_beef,
            block_size: 16,
            start: 0,
            values: vec![1, u64::MAX],
        }],
    };
    let mut values = 1u64.to_le_bytes().to_vec();
    values.extend_from_slice(&u64::MAX.to_le_bytes());
    let by_hand = raw(&(
        1u32,
        2u32,
        20u64,
        vec![(1u64, 0xdead_beefu64, 16u64, 0u64, Bin(values))],
    ));
    assert_eq!(p.encode().unwrap(), by_hand);
    assert_eq!(PAYLOAD_VERSION, 1);
}

#[test]
fn a_128k_token_prompt_is_about_87_kb() {
    let p = Payload {
        tp_size: 1,
        num_tokens: 128 * 1024,
        groups: vec![PayloadGroup {
            group_id: 0,
            fingerprint: u64::MAX,
            block_size: 16,
            start: 0,
            values: (0..128 * 1024 / 16)
                .map(|i: u64| i.wrapping_mul(u64::MAX / 3))
                .collect(),
        }],
    };
    let s = p.encode().unwrap();
    assert!((87_000..88_000).contains(&s.len()), "{} bytes", s.len());
    assert_eq!(Payload::decode(&s), Ok(p));
}

#[test]
fn invalid_payloads_are_malformed_or_another_version() {
    let m = UnverifiedReason::Malformed;
    let group = |bs: u64, bytes: Vec<u8>| (0u64, 7u64, bs, 0u64, Bin(bytes));
    // values that are not whole u64s
    assert_eq!(
        Payload::decode(&raw(&(1u32, 1u32, 8u64, vec![group(16, vec![0; 12])]))),
        Err(m)
    );
    // block size 0
    assert_eq!(
        Payload::decode(&raw(&(1u32, 1u32, 8u64, vec![group(0, vec![0; 8])]))),
        Err(m)
    );
    // two entries for one group
    assert_eq!(
        Payload::decode(&raw(&(
            1u32,
            1u32,
            8u64,
            vec![group(16, vec![]), group(16, vec![])]
        ))),
        Err(m)
    );
    // tp_size 0
    assert_eq!(
        Payload::decode(&raw(&(1u32, 0u32, 8u64, Vec::<u8>::new()))),
        Err(m)
    );
    // values as an array of integers instead of bin
    assert_eq!(
        Payload::decode(&raw(&(
            1u32,
            1u32,
            8u64,
            vec![(0u64, 7u64, 16u64, 0u64, vec![1u64])]
        ))),
        Err(m)
    );
    // positions whose tokens overflow
    assert_eq!(
        Payload::decode(&raw(&(
            1u32,
            1u32,
            8u64,
            vec![(0u64, 7u64, 16u64, u64::MAX / 8, Bin(vec![0; 8]))]
        ))),
        Err(m)
    );
    // too few and too many elements
    assert_eq!(Payload::decode(&raw(&(1u32, 1u32, 8u64))), Err(m));
    assert_eq!(
        Payload::decode(&raw(&(1u32, 1u32, 8u64, Vec::<u8>::new(), 5u8))),
        Err(m)
    );
    // a map, a string, a version that is not an integer
    assert_eq!(
        Payload::decode(&raw(&std::collections::BTreeMap::from([(1u8, 2u8)]))),
        Err(m)
    );
    assert_eq!(Payload::decode(&raw(&"hello")), Err(m));
    assert_eq!(
        Payload::decode(&raw(&("1", 1u32, 8u64, Vec::<u8>::new()))),
        Err(m)
    );
    // other versions, whatever follows
    let v = UnverifiedReason::Version;
    assert_eq!(
        Payload::decode(&raw(&(0u32, 1u32, 8u64, Vec::<u8>::new()))),
        Err(v)
    );
    assert_eq!(Payload::decode(&raw(&(2u32, "anything", 1.5f64))), Err(v));
    assert_eq!(Payload::decode(&raw(&(99u32,))), Err(v));
    // base64 that is not base64
    assert_eq!(Payload::decode("@@@@"), Err(m));
}
