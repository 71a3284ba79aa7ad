//! What a worker reports for one request: per KV cache group, its partial checksums (per replica
//! key) or why it skipped the group.
//!
//! Invariants: a record names every group of the request it was given, each exactly once; a
//! computed group's parts all hold one value per scheduled block position; a part is keyed by
//! the [`ReplicaKey`] of the layers summed into it, with `index < replicas`. Records are plain
//! serde data so they can cross a process boundary.

use serde::{Deserialize, Serialize};

/// Which worker of the TP x PP grid wrote a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerId {
    pub tp_rank: u32,
    pub pp_rank: u32,
}

/// How many TP ranks hold the same KV heads of a layer, and which copy this rank holds.
/// `ReplicaKey { replicas: 1, index: 0 }` is a layer whose heads are not replicated.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default,
)]
pub struct ReplicaKey {
    pub replicas: u32,
    pub index: u32,
}

impl ReplicaKey {
    /// Not replicated.
    pub const SINGLE: ReplicaKey = ReplicaKey {
        replicas: 1,
        index: 0,
    };

    /// Whether `index < replicas` (and `replicas > 0`).
    pub fn is_valid(&self) -> bool {
        self.index < self.replicas
    }
}

/// Why a group is not checksummed on one side. A group skipped on both sides is left out of the
/// verdict; skipped on one side only, it is unverified.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SkipReason {
    /// A token's K and V rows of one head are not whole 8-byte pieces.
    NotWholePieces {
        layer: String,
        bytes_per_token: usize,
    },
    /// A layer's kernel blocks do not tile its cache blocks.
    KernelBlocksDoNotTile { layer: String },
    /// A layer's memory layout does not match the group's spec (block size, heads, head_dim,
    /// dtype).
    LayoutDiffersFromSpec { layer: String },
    /// A layer name without a layer number.
    LayerWithoutNumber { layer: String },
    /// Two caches with one layer number from different modules (e.g. a main and an MTP layer).
    DuplicateLayerNumber { number: u32 },
    /// KV heads beyond the factor's bound of 2^16 per layer, or a head placement outside the
    /// model's heads.
    HeadsOutOfRange { layer: String },
    /// The block table has a null block after a non-null one in the checksummed range.
    NullBlockAfterNonNull,
    /// The block table does not reach the checksummed range.
    BlockTableTooShort,
}

impl SkipReason {
    /// A fixed label, for logs and metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            SkipReason::NotWholePieces { .. } => "not_whole_pieces",
            SkipReason::KernelBlocksDoNotTile { .. } => "kernel_blocks_do_not_tile",
            SkipReason::LayoutDiffersFromSpec { .. } => "layout_differs_from_spec",
            SkipReason::LayerWithoutNumber { .. } => "layer_without_number",
            SkipReason::DuplicateLayerNumber { .. } => "duplicate_layer_number",
            SkipReason::HeadsOutOfRange { .. } => "heads_out_of_range",
            SkipReason::NullBlockAfterNonNull => "null_block_after_non_null",
            SkipReason::BlockTableTooShort => "block_table_too_short",
        }
    }
}

/// One worker's partial checksums of one replica key: one value per scheduled block position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaPart {
    pub key: ReplicaKey,
    pub values: Vec<u64>,
}

/// What a worker computed for one group of a request; it echoes the scheduled blocks so the
/// scheduler can tell that the worker checksummed what it was asked to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupValues {
    pub block_size: usize,
    /// First block position.
    pub start: usize,
    /// First token covered (the first block covers `[first_token, (start + 1) * block_size)`).
    pub first_token: usize,
    /// The request's token count; the last block covers only tokens before it.
    pub num_tokens: usize,
    /// [`crate::ScheduledGroup::digest`] of the blocks the worker read.
    pub blocks_digest: u64,
    /// Number of block positions (every part holds this many values).
    pub num_blocks: usize,
    /// Partial sums per replica key; empty when this worker holds none of the group's layers or
    /// (producer) only copies other than replica 0.
    pub parts: Vec<ReplicaPart>,
}

/// A worker's outcome for one group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GroupOutcome {
    Computed(GroupValues),
    Skipped(SkipReason),
    /// The backend refused the job (a bug, not a property of the group): the group is
    /// unverified, never silently ignored.
    Failed(String),
}

/// One worker's record of one group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    pub group_id: usize,
    /// Wrapping sum of [`crate::layer_fingerprint`] over this worker's layers of the group.
    pub fingerprint: u64,
    pub outcome: GroupOutcome,
}

/// One worker's checksum record of one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub worker: WorkerId,
    pub groups: Vec<GroupRecord>,
}
