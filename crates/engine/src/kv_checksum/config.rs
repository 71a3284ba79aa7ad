//! The engine's KV checksum settings, mapped from `kv_transfer_config`:
//! `enable_kv_checksum` -> [`KvChecksumConfig::enabled`], `kv_checksum_fail_closed` ->
//! [`KvChecksumConfig::fail_closed`], `kv_fault_injection` -> [`KvChecksumConfig::fault_injection`].
//!
//! Invariant: a parsed [`FaultInjection`] has a probability in `[0, 1]` and a known kind; any
//! other JSON is refused at startup, never ignored.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use tandem_kv_connector::KvTransferConfig;

use crate::error::EngineError;

/// How long a finished producer request waits for its checksum records before it answers
/// without checksums.
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// KV checksum settings of one instance.
#[derive(Debug, Clone, PartialEq)]
pub struct KvChecksumConfig {
    /// Checksum what this instance sends and verify what it loads.
    pub enabled: bool,
    /// A mismatched or unverified load is a KV load failure (else only logged and counted).
    pub fail_closed: bool,
    /// Faults injected into loads, for tests and demos.
    pub fault_injection: Option<FaultInjection>,
    /// How long a finished producer request waits for its checksum records.
    pub send_timeout: Duration,
}

impl Default for KvChecksumConfig {
    fn default() -> Self {
        KvChecksumConfig {
            enabled: false,
            fail_closed: false,
            fault_injection: None,
            send_timeout: DEFAULT_SEND_TIMEOUT,
        }
    }
}

impl KvChecksumConfig {
    /// The settings of `kv_transfer_config`'s keys; `fault_injection` is the raw
    /// `kv_fault_injection` object.
    pub fn new(
        enabled: bool,
        fail_closed: bool,
        fault_injection: Option<&Value>,
    ) -> Result<Self, EngineError> {
        Ok(KvChecksumConfig {
            enabled,
            fail_closed,
            fault_injection: fault_injection.map(FaultInjection::from_json).transpose()?,
            send_timeout: DEFAULT_SEND_TIMEOUT,
        })
    }

    /// The settings of a parsed `--kv-transfer-config`.
    pub fn from_transfer_config(config: &KvTransferConfig) -> Result<Self, EngineError> {
        Self::new(
            config.enable_kv_checksum,
            config.kv_checksum_fail_closed,
            config.kv_fault_injection.as_ref(),
        )
    }
}

/// The workers of one instance: TP ranks x PP stages, each reporting its own checksum record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerGrid {
    pub tp_size: u32,
    pub pp_size: u32,
}

impl Default for WorkerGrid {
    fn default() -> Self {
        WorkerGrid {
            tp_size: 1,
            pp_size: 1,
        }
    }
}

/// What an injected fault does to a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// Flips one bit of one loaded block (random layer, K or V, token, head, byte).
    CorruptByte,
    /// Swaps the contents of two loaded blocks (a single block is corrupted instead).
    SwapBlocks,
    /// Overwrites every loaded block with other KV, as if the producer had reused its blocks
    /// before the consumer read them.
    StaleBlocks,
    /// The producer's checksums do not arrive.
    DropChecksums,
    /// The producer's checksums arrive as garbage.
    MalformChecksums,
}

impl FaultKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::CorruptByte => "corrupt_byte",
            FaultKind::SwapBlocks => "swap_blocks",
            FaultKind::StaleBlocks => "stale_blocks",
            FaultKind::DropChecksums => "drop_checksums",
            FaultKind::MalformChecksums => "malform_checksums",
        }
    }

    /// Whether the fault changes the loaded KV (applied by workers) rather than the expected
    /// checksums (applied by the scheduler).
    pub fn touches_blocks(self) -> bool {
        matches!(
            self,
            FaultKind::CorruptByte | FaultKind::SwapBlocks | FaultKind::StaleBlocks
        )
    }
}

fn one() -> f64 {
    1.0
}

/// `kv_fault_injection`: `{"kind": …, "probability": p, "seed": s, "block_position": b}`; each
/// load gets the fault with probability `p` (default 1), drawn from an RNG seeded with `s`
/// (default 0). `block_position` (`corrupt_byte` only) puts the byte in the request's block `b`
/// (counted from the prompt's first block) instead of a random loaded block; a load that does
/// not hold block `b` is left alone. `tp_rank` (TP instances) corrupts only that TP rank's copy
/// of the load (with replicated KV heads: one replica only); by default every rank's. `group`
/// touches only that KV cache group's layers (e.g. 1, Gemma 3's sliding-window group).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultInjection {
    pub kind: FaultKind,
    #[serde(default = "one")]
    pub probability: f64,
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub block_position: Option<usize>,
    #[serde(default)]
    pub tp_rank: Option<u32>,
    #[serde(default)]
    pub group: Option<usize>,
}

impl FaultInjection {
    /// Parses and checks the JSON object.
    pub fn from_json(value: &Value) -> Result<Self, EngineError> {
        let f = FaultInjection::deserialize(value).map_err(|e| {
            EngineError::InvalidConfig(format!(
                "kv_fault_injection: {e} (expected {{\"kind\": \"corrupt_byte\" | \"swap_blocks\" | \
                 \"stale_blocks\" | \"drop_checksums\" | \"malform_checksums\", \"probability\": p, \
                 \"seed\": s, \"block_position\": b, \"tp_rank\": r, \"group\": g}})"
            ))
        })?;
        if !(0.0..=1.0).contains(&f.probability) {
            return Err(EngineError::InvalidConfig(format!(
                "kv_fault_injection: probability {} is not in [0, 1]",
                f.probability
            )));
        }
        if f.block_position.is_some() && f.kind != FaultKind::CorruptByte {
            return Err(EngineError::InvalidConfig(format!(
                "kv_fault_injection: block_position applies to kind \"corrupt_byte\" only, not \
                 {:?}",
                f.kind.as_str()
            )));
        }
        Ok(f)
    }
}

/// A fault drawn for one load, handed to every worker with the load's job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockFault {
    pub kind: FaultKind,
    /// Seeds the worker's choice of block, layer, token and byte.
    pub seed: u64,
    /// The block position to corrupt, instead of a random one.
    pub block_position: Option<usize>,
    /// Only this TP rank's workers inject it (all when `None`).
    pub tp_rank: Option<u32>,
    /// Only this KV cache group's layers are touched (all when `None`).
    pub group: Option<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fault_injection_parses_and_refuses_nonsense() {
        let f = FaultInjection::from_json(
            &json!({"kind": "corrupt_byte", "probability": 0.5, "seed": 7}),
        )
        .unwrap();
        assert_eq!(
            f,
            FaultInjection {
                kind: FaultKind::CorruptByte,
                probability: 0.5,
                seed: 7,
                block_position: None,
                tp_rank: None,
                group: None,
            }
        );
        let f = FaultInjection::from_json(
            &json!({"kind": "corrupt_byte", "block_position": 3, "tp_rank": 1}),
        )
        .unwrap();
        assert_eq!((f.block_position, f.tp_rank), (Some(3), Some(1)));
        let f = FaultInjection::from_json(&json!({"kind": "stale_blocks"})).unwrap();
        assert_eq!((f.probability, f.seed), (1.0, 0));
        for bad in [
            json!({"kind": "melt"}),
            json!({"probability": 1.0}),
            json!({"kind": "swap_blocks", "probability": 1.5}),
            json!({"kind": "swap_blocks", "probablity": 0.5}),
            json!({"kind": "swap_blocks", "block_position": 1}),
            json!({"kind": "corrupt_byte", "block_position": -1}),
            json!([1]),
        ] {
            let e = FaultInjection::from_json(&bad).unwrap_err();
            assert!(matches!(e, EngineError::InvalidConfig(_)), "{bad}: {e}");
        }
    }

    #[test]
    fn config_maps_the_transfer_config_keys() {
        let c =
            KvChecksumConfig::new(true, true, Some(&json!({"kind": "drop_checksums"}))).unwrap();
        assert!(c.enabled && c.fail_closed);
        assert_eq!(c.fault_injection.unwrap().kind, FaultKind::DropChecksums);
        assert_eq!(
            KvChecksumConfig::default().send_timeout,
            DEFAULT_SEND_TIMEOUT
        );
    }
}
