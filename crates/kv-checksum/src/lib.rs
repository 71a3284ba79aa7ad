//! End-to-end checksums of transferred KV: the definition, the worker side, the scheduler side
//! and the wire format. Nothing here needs a running connector; the engine and the connectors
//! call it.
//!
//! # The definition
//!
//! One value per (KV cache group, block position), over the unsharded model:
//! - a *slice* is one layer's, one KV head's K and V for the block's tokens, token by token (the
//!   token's K row, then its V row, in the cache dtype), cut into little-endian `u64` pieces;
//!   `x_j` is piece `p` of the token at position `t` in the request, `j = t * P + p`, `P` pieces
//!   per token (`P = 2 * head_dim * dtype_size / 8`; a cache whose rows are not whole pieces is
//!   skipped);
//! - `s = Σ x_j (2j + 1) mod 2^64`;
//! - `c = Σ_{layer, head} m s mod 2^64`, `m = 2 (layer * 2^16 + head) + 1`, with `layer` the
//!   number in the layer's name and `head` the KV head's global index across TP ranks;
//! - the last block covers only the request's first `num_tokens` positions.
//!
//! Weights and factors are odd, so any single-piece change changes `c`; distinct weights catch
//! tokens in the wrong place and distinct factors swapped heads or layers. Workers' parts add up
//! to `c` whatever the TP/PP split and memory layout, and consecutive blocks add up to the larger
//! block holding the same tokens. It is not a cryptographic hash.
//!
//! # Life of a request
//!
//! Producer: the scheduler selects the prompt's blocks ([`ChecksumRequest::for_send`]) in the step
//! that finishes the prefill; every worker checksums them after the forward
//! ([`WorkerChecksums::checksum`] with [`Role::Producer`], on a [`ChecksumBackend`] such as
//! [`CpuBackend`]) and returns a [`RequestRecord`]; the scheduler merges the TP x PP records
//! ([`RecordMerger`]), builds the [`Payload`] and sends [`Payload::encode`] as
//! `kv_transfer_params["kv_checksums"]` (or in the connector's own messages).
//!
//! Consumer: the scheduler selects the blocks a load writes ([`ChecksumRequest::for_load`]);
//! workers checksum them when the load finishes ([`Role::Consumer`]: every replica); the
//! scheduler merges the records and calls [`verify`] (or [`Payload::decode`] + [`compare`]) to get
//! a [`Verdict`]: verified, mismatch (groups and block positions), or unverified with a fixed
//! [`UnverifiedReason`].
//!
//! Outside tools: [`checksum_safetensors_file`] is the backend of `tandem kv-checksum`.
//!
//! # Modules
//! - [`definition`]: factors, weights, pieces, fingerprints.
//! - `kernel`: the CPU inner loop (private).
//! - [`backend`]: [`ChecksumBackend`], its jobs, the CPU backend and [`KvSource`].
//! - [`worker`]: per-worker setup and per-request records.
//! - [`incremental`]: one request's records computed in parts, as a load's chunks land.
//! - [`record`]: what a worker reports.
//! - [`schedule`]: which blocks are checksummed.
//! - [`merge`]: summing the workers' records.
//! - [`verdict`]: comparing the two sides.
//! - [`wire`]: the payload format.
//! - [`file`](mod@file): checksums of a safetensors file.

pub mod backend;
pub mod definition;
pub mod error;
pub mod file;
pub mod incremental;
mod kernel;
pub mod merge;
pub mod record;
pub mod schedule;
pub mod verdict;
pub mod wire;
pub mod worker;

pub use backend::{
    check_block, check_layer_shape, BlockJob, ChecksumBackend, CpuBackend, GroupJob, KvSource,
    LayerJob, SharedBackend,
};
pub use definition::{
    head_factor, layer_fingerprint, piece_weight, pieces_per_token, MAX_KV_HEADS_PER_LAYER,
    PIECE_BYTES,
};
pub use error::KvChecksumError;
pub use file::{checksum_safetensors, checksum_safetensors_file, FileChecksums};
pub use incremental::IncrementalChecksum;
pub use merge::{GroupChecks, MergedChecksums, MergedGroup, MergedState, RecordMerger};
pub use record::{
    GroupOutcome, GroupRecord, GroupValues, ReplicaKey, ReplicaPart, RequestRecord, SkipReason,
    WorkerId,
};
pub use schedule::{select_blocks, BlockId, ChecksumRequest, GroupBlocks, ScheduledGroup};
pub use verdict::{compare, verify, GroupMismatch, UnverifiedReason, Verdict};
pub use wire::{Payload, PayloadGroup, PAYLOAD_VERSION};
pub use worker::{CacheLayer, HeadPlacement, Role, WorkerChecksums, WorkerGroup};
