//! Faults injected where the KV bytes move (testing only): what a broken network, a buggy
//! producer or a slow consumer does to a transfer, for the checksums to catch. Configured with
//! `kv_connector_extra_config.transport_fault_injection`:
//! `{"kind": "corrupt_source" | "wrong_block" | "slow_read" | "drop_checksums" |
//!   "garble_notif", "probability": p, "seed": s, "delay": seconds}`.
//!
//! - `corrupt_source` (producer): when a consumer's claim is granted, flip one bit of one byte of
//!   one leased block in the producer's memory: after the prompt's checksums were taken, before
//!   the READ. The byte lies in a token the checksums cover.
//! - `wrong_block` (consumer): the READ takes one position of the prompt from another of the
//!   producer's blocks (two positions swapped, or a neighbouring block for a one-block prompt).
//! - `slow_read` (consumer): after its claim is granted, the consumer waits `delay` seconds
//!   before it renews the lease and posts the READ. With a producer lease shorter than that, the
//!   producer frees the blocks (and may reuse them) while the consumer still means to read them:
//!   the race of a slow consumer, made deterministic.
//! - Push mode (producer): `wrong_block` makes the WRITE take one position from another of the
//!   producer's blocks; `drop_checksums` sends the completion notification without the
//!   checksums; `garble_notif` sends a checksum notification that does not decode.
//!
//! Each fault is decided per transfer by an RNG seeded with `seed` (probability `p`, default 1),
//! and logged as a warning when injected. Invariant: a fault only writes blocks of a lease the
//! producer holds and no one else writes (`corrupt_source`), or changes what the consumer asks
//! for (`wrong_block`, `slow_read`); it never touches another request's memory on the consumer.

use std::time::Duration;

use serde_json::{Map, Value};
use tandem_kv_cache::{KvPart, KvStorage};

use crate::config::KvRole;
use crate::error::KvConnectorError;

/// What to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportFaultKind {
    CorruptSource,
    WrongBlock,
    SlowRead,
    DropChecksums,
    GarbleNotif,
}

impl TransportFaultKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TransportFaultKind::CorruptSource => "corrupt_source",
            TransportFaultKind::WrongBlock => "wrong_block",
            TransportFaultKind::SlowRead => "slow_read",
            TransportFaultKind::DropChecksums => "drop_checksums",
            TransportFaultKind::GarbleNotif => "garble_notif",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "corrupt_source" => TransportFaultKind::CorruptSource,
            "wrong_block" => TransportFaultKind::WrongBlock,
            "slow_read" => TransportFaultKind::SlowRead,
            "drop_checksums" => TransportFaultKind::DropChecksums,
            "garble_notif" => TransportFaultKind::GarbleNotif,
            _ => return None,
        })
    }
}

/// A parsed `transport_fault_injection`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransportFault {
    pub kind: TransportFaultKind,
    pub probability: f64,
    pub seed: u64,
    /// `slow_read` only.
    pub delay: Duration,
}

fn invalid(msg: String) -> KvConnectorError {
    KvConnectorError::InvalidConfig(format!("transport_fault_injection: {msg}"))
}

impl TransportFault {
    /// Parses the object strictly (unknown keys, a missing kind or delay, a delay for a kind
    /// that takes none, a probability outside `[0, 1]`: errors) for an instance of `role`.
    pub fn parse(obj: &Map<String, Value>, role: KvRole) -> Result<Self, KvConnectorError> {
        for k in obj.keys() {
            if !["kind", "probability", "seed", "delay"].contains(&k.as_str()) {
                return Err(invalid(format!(
                    "unknown key {k:?} (known: kind, probability, seed, delay)"
                )));
            }
        }
        let kind = obj
            .get("kind")
            .and_then(Value::as_str)
            .and_then(TransportFaultKind::parse)
            .ok_or_else(|| {
                invalid(
                    "kind must be \"corrupt_source\", \"wrong_block\", \"slow_read\", \
                     \"drop_checksums\" or \"garble_notif\""
                        .into(),
                )
            })?;
        let probability = match obj.get("probability") {
            None => 1.0,
            Some(v) => v
                .as_f64()
                .filter(|p| (0.0..=1.0).contains(p))
                .ok_or_else(|| invalid(format!("probability must be in [0, 1], got {v}")))?,
        };
        let seed = match obj.get("seed") {
            None => 0,
            Some(v) => v
                .as_u64()
                .ok_or_else(|| invalid(format!("seed must be a non-negative integer, got {v}")))?,
        };
        let delay = match (kind, obj.get("delay")) {
            (TransportFaultKind::SlowRead, Some(v)) => v
                .as_f64()
                .filter(|s| *s > 0.0 && *s <= 3600.0)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| invalid(format!("delay must be 0 < seconds <= 3600, got {v}")))?,
            (TransportFaultKind::SlowRead, None) => {
                return Err(invalid("slow_read needs \"delay\" (seconds)".into()))
            }
            (_, Some(_)) => {
                return Err(invalid(format!(
                    "delay applies to slow_read only, not {}",
                    kind.as_str()
                )))
            }
            (_, None) => Duration::ZERO,
        };
        // wrong_block is the consumer's in pull mode and the producer's in push mode: the
        // connector checks it against its mode.
        let needs_producer = matches!(
            kind,
            TransportFaultKind::CorruptSource
                | TransportFaultKind::DropChecksums
                | TransportFaultKind::GarbleNotif
        );
        let any_role = kind == TransportFaultKind::WrongBlock;
        if !any_role
            && (needs_producer && !role.is_producer() || !needs_producer && !role.is_consumer())
        {
            return Err(invalid(format!(
                "{} is injected by a {}, not a {}",
                kind.as_str(),
                if needs_producer {
                    "producer"
                } else {
                    "consumer"
                },
                role.as_str()
            )));
        }
        Ok(TransportFault {
            kind,
            probability,
            seed,
            delay,
        })
    }

    /// The JSON form (for the config's `to_value`).
    pub fn to_value(&self) -> Value {
        let mut v = serde_json::json!({"kind": self.kind.as_str(),
            "probability": self.probability, "seed": self.seed});
        if self.kind == TransportFaultKind::SlowRead {
            v["delay"] = Value::from(self.delay.as_secs_f64());
        }
        v
    }
}

/// splitmix64: a small deterministic RNG, the same on every platform and dependency version
/// (the fault injectors' RNG, here and in the engine's checksum faults).
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)`; `n > 0`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`.
    pub fn hit(&mut self, p: f64) -> bool {
        self.unit() < p
    }
}

/// `corrupt_source`: flips one bit in a covered token of one of `blocks` (the prompt's
/// `num_tokens` tokens, in prompt order). Returns what it did, for the log.
///
/// # Safety
/// The caller must own `blocks` (a lease nobody reads or writes during the call).
pub(crate) unsafe fn corrupt_source(
    storage: &KvStorage,
    tables: &[Vec<u32>],
    num_tokens: usize,
    rng: &mut SplitMix,
) -> Option<String> {
    let layers = storage.num_layers();
    if layers == 0 || tables.is_empty() || num_tokens == 0 {
        return None;
    }
    let layer = rng.below(layers);
    let group = storage.layer_group(layer);
    // The layer's group's table (or the one every group shares).
    let blocks = tandem_kv_cache::group_table(tables, group)?;
    let layout = storage.layout(layer);
    let bs = layout.block_size;
    let held: Vec<usize> = (0..blocks.len().min(num_tokens.div_ceil(bs)))
        .filter(|&p| blocks[p] != tandem_kv_cache::NULL_BLOCK)
        .collect();
    if held.is_empty() {
        return None;
    }
    let pos = held[rng.below(held.len())];
    let covered = (num_tokens - pos * bs).min(bs);
    let token = rng.below(covered);
    let head = rng.below(layout.num_kv_heads);
    let part = if rng.below(2) == 0 {
        KvPart::K
    } else {
        KvPart::V
    };
    let byte = layout.row_offset(0, token, head) + rng.below(layout.row_bytes());
    let bit = rng.below(8);
    let block = blocks[pos] as usize;
    // SAFETY: the caller owns the block; the offset lies inside it (row of a token < bs).
    unsafe { storage.modify_block(layer, part, block, |b| b[byte] ^= 1 << bit) }.ok()?;
    Some(format!(
        "flipped bit {bit} of byte {byte} of {part:?} block {block} (prompt position {pos}, \
         token {token}, head {head}) of layer {layer} (group {group})"
    ))
}

/// `wrong_block`: changes which producer blocks the READ takes. Returns what it did.
pub(crate) fn wrong_block(remote: &mut [usize], rng: &mut SplitMix) -> Option<String> {
    match remote.len() {
        0 => None,
        1 => {
            let was = remote[0];
            remote[0] = if was == 0 { 1 } else { was - 1 };
            Some(format!(
                "reads producer block {} instead of {was}",
                remote[0]
            ))
        }
        n => {
            let a = rng.below(n);
            let b = (a + 1 + rng.below(n - 1)) % n;
            remote.swap(a, b);
            Some(format!(
                "reads prompt positions {a} and {b} from each other's block"
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value, role: KvRole) -> Result<TransportFault, KvConnectorError> {
        TransportFault::parse(v.as_object().unwrap(), role)
    }

    #[test]
    fn parsing_is_strict_and_role_aware() {
        let f = parse(json!({"kind": "slow_read", "delay": 1.5}), KvRole::Consumer).unwrap();
        assert_eq!(f.delay, Duration::from_millis(1500));
        assert_eq!((f.probability, f.seed), (1.0, 0));
        assert_eq!(parse(f.to_value(), KvRole::Consumer).unwrap(), f);
        parse(
            json!({"kind": "corrupt_source", "seed": 3}),
            KvRole::Producer,
        )
        .unwrap();
        parse(
            json!({"kind": "wrong_block", "probability": 0.5}),
            KvRole::Both,
        )
        .unwrap();
        for (bad, role, needle) in [
            (json!({"kind": "melt"}), KvRole::Both, "kind must be"),
            (json!({}), KvRole::Both, "kind must be"),
            (
                json!({"kind": "slow_read"}),
                KvRole::Consumer,
                "needs \"delay\"",
            ),
            (
                json!({"kind": "wrong_block", "delay": 1}),
                KvRole::Consumer,
                "slow_read only",
            ),
            (
                json!({"kind": "wrong_block", "probability": 2}),
                KvRole::Consumer,
                "[0, 1]",
            ),
            (
                json!({"kind": "wrong_block", "seed": -1}),
                KvRole::Consumer,
                "seed",
            ),
            (
                json!({"kind": "wrong_block", "dealy": 1}),
                KvRole::Consumer,
                "unknown key",
            ),
            (
                json!({"kind": "corrupt_source"}),
                KvRole::Consumer,
                "by a producer",
            ),
            (
                json!({"kind": "slow_read", "delay": 1.0}),
                KvRole::Producer,
                "by a consumer",
            ),
            (
                json!({"kind": "drop_checksums"}),
                KvRole::Consumer,
                "by a producer",
            ),
        ] {
            let e = parse(bad.clone(), role).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn wrong_block_always_changes_the_read() {
        let mut rng = SplitMix::new(9);
        for n in 1..6 {
            for _ in 0..20 {
                let orig: Vec<usize> = (0..n).map(|i| 10 + i).collect();
                let mut r = orig.clone();
                assert!(wrong_block(&mut r, &mut rng).is_some());
                assert_ne!(r, orig);
            }
        }
        assert!(wrong_block(&mut [], &mut rng).is_none());
    }
}
