//! The wire format of a producer's checksums: base64 (standard alphabet, padded) of msgpack
//! `[version, tp_size, num_tokens, [[group_id, fingerprint, block_size, start, values]]]`, with
//! `values` a msgpack bin of the little-endian `u64` block checksums of positions
//! `start, start + 1, …`.
//!
//! Invariants: encoding then decoding is the identity; decoding any bytes or string never
//! panics and never allocates more than the input's size suggests: what does not decode is
//! [`UnverifiedReason::Malformed`], another version is [`UnverifiedReason::Version`]. A decoded
//! payload has positive block sizes, distinct group ids and positions whose tokens fit in `u64`.

use std::fmt;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use serde::de::{self, IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::KvChecksumError;
use crate::merge::{MergedChecksums, MergedState};
use crate::verdict::UnverifiedReason;

/// The payload version this build writes and reads.
pub const PAYLOAD_VERSION: u32 = 1;

/// One group's checksums in a payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadGroup {
    pub group_id: usize,
    pub fingerprint: u64,
    pub block_size: usize,
    /// Position of `values[0]`; the producer covers whole blocks from `start * block_size`.
    pub start: usize,
    pub values: Vec<u64>,
}

/// A producer's checksums of one request: tokens `[0, num_tokens)`, per group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    /// The producer's TP size (informational).
    pub tp_size: u32,
    pub num_tokens: usize,
    /// Groups the producer checksummed; a group it skipped is absent.
    pub groups: Vec<PayloadGroup>,
}

impl Payload {
    /// The payload of a producer's merged checksums (check 0 of each computed group; skipped
    /// groups left out). A group that is unverified on the producer means no payload at all.
    pub fn from_merged(merged: &MergedChecksums) -> Result<Payload, UnverifiedReason> {
        let mut groups = Vec::new();
        for g in &merged.groups {
            match &g.state {
                MergedState::Skipped(_) => {}
                MergedState::Unverified(r) => return Err(*r),
                MergedState::Computed(c) => {
                    if Some(c.first_token) != c.start.checked_mul(c.block_size) {
                        return Err(UnverifiedReason::UnalignedFirstBlock);
                    }
                    groups.push(PayloadGroup {
                        group_id: g.group_id,
                        fingerprint: c.fingerprint,
                        block_size: c.block_size,
                        start: c.start,
                        values: c.checks.first().cloned().unwrap_or_default(),
                    });
                }
            }
        }
        Ok(Payload {
            tp_size: merged.tp_size,
            num_tokens: merged.num_tokens,
            groups,
        })
    }

    pub fn group(&self, group_id: usize) -> Option<&PayloadGroup> {
        self.groups.iter().find(|g| g.group_id == group_id)
    }

    /// The msgpack bytes (for carriers that move bytes, e.g. a push notification).
    pub fn to_msgpack(&self) -> Result<Vec<u8>, KvChecksumError> {
        let groups: Vec<_> = self
            .groups
            .iter()
            .map(|g| {
                let mut bytes = Vec::with_capacity(8 * g.values.len());
                for v in &g.values {
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
                (
                    g.group_id as u64,
                    g.fingerprint,
                    g.block_size as u64,
                    g.start as u64,
                    Bin(bytes),
                )
            })
            .collect();
        rmp_serde::to_vec(&(
            PAYLOAD_VERSION,
            self.tp_size,
            self.num_tokens as u64,
            groups,
        ))
        .map_err(|e| KvChecksumError::Encode(e.to_string()))
    }

    /// The base64 string carried in `kv_transfer_params["kv_checksums"]`.
    pub fn encode(&self) -> Result<String, KvChecksumError> {
        Ok(STANDARD.encode(self.to_msgpack()?))
    }

    /// Decodes msgpack bytes. Never panics.
    pub fn from_msgpack(bytes: &[u8]) -> Result<Payload, UnverifiedReason> {
        match rmp_serde::from_slice::<Raw>(bytes) {
            Ok(Raw::OtherVersion) => Err(UnverifiedReason::Version),
            Ok(Raw::V1(p)) => validate(p),
            Err(_) => Err(UnverifiedReason::Malformed),
        }
    }

    /// Decodes the base64 string. Never panics.
    pub fn decode(s: &str) -> Result<Payload, UnverifiedReason> {
        let bytes = STANDARD
            .decode(s.trim())
            .map_err(|_| UnverifiedReason::Malformed)?;
        Self::from_msgpack(&bytes)
    }
}

fn validate(p: Payload) -> Result<Payload, UnverifiedReason> {
    let malformed = Err(UnverifiedReason::Malformed);
    if p.tp_size == 0 {
        return malformed;
    }
    let mut ids: Vec<usize> = p.groups.iter().map(|g| g.group_id).collect();
    ids.sort_unstable();
    ids.dedup();
    if ids.len() != p.groups.len() {
        return malformed;
    }
    for g in &p.groups {
        let end_token = g
            .start
            .checked_add(g.values.len())
            .and_then(|end| end.checked_mul(g.block_size));
        if g.block_size == 0 || end_token.is_none() {
            return malformed;
        }
    }
    Ok(p)
}

/// A msgpack bin.
struct Bin(Vec<u8>);

impl Serialize for Bin {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Bin {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct BinVisitor;
        impl Visitor<'_> for BinVisitor {
            type Value = Bin;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a msgpack bin")
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Bin, E> {
                Ok(Bin(v.to_vec()))
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Bin, E> {
                Ok(Bin(v))
            }
        }
        d.deserialize_bytes(BinVisitor)
    }
}

/// A decoded payload of any version.
enum Raw {
    OtherVersion,
    V1(Payload),
}

type RawGroup = (u64, u64, u64, u64, Bin);

impl<'de> Deserialize<'de> for Raw {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct RawVisitor;
        impl<'de> Visitor<'de> for RawVisitor {
            type Value = Raw;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a KV checksum payload array")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Raw, A::Error> {
                let missing = |i| de::Error::invalid_length(i, &"4 elements");
                let version: u64 = seq.next_element()?.ok_or_else(|| missing(0))?;
                if version != PAYLOAD_VERSION as u64 {
                    while seq.next_element::<IgnoredAny>()?.is_some() {}
                    return Ok(Raw::OtherVersion);
                }
                let tp_size: u32 = seq.next_element()?.ok_or_else(|| missing(1))?;
                let num_tokens: u64 = seq.next_element()?.ok_or_else(|| missing(2))?;
                let groups: Vec<RawGroup> = seq.next_element()?.ok_or_else(|| missing(3))?;
                if seq.next_element::<IgnoredAny>()?.is_some() {
                    return Err(de::Error::invalid_length(5, &"4 elements"));
                }
                let usize_of = |x: u64| {
                    usize::try_from(x).map_err(|_| de::Error::custom("integer out of range"))
                };
                let groups = groups
                    .into_iter()
                    .map(|(group_id, fingerprint, block_size, start, Bin(bytes))| {
                        if bytes.len() % 8 != 0 {
                            return Err(de::Error::custom("values are not whole u64s"));
                        }
                        Ok(PayloadGroup {
                            group_id: usize_of(group_id)?,
                            fingerprint,
                            block_size: usize_of(block_size)?,
                            start: usize_of(start)?,
                            values: bytes
                                .chunks_exact(8)
                                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                                .collect(),
                        })
                    })
                    .collect::<Result<Vec<_>, A::Error>>()?;
                Ok(Raw::V1(Payload {
                    tp_size,
                    num_tokens: usize_of(num_tokens)?,
                    groups,
                }))
            }
        }
        d.deserialize_seq(RawVisitor)
    }
}
