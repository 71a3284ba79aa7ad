//! The worker side: which of a worker's caches belong to each group, how their heads are
//! numbered globally, and the per-request record of partial checksums.
//!
//! A worker (one TP rank of one PP stage) holds some layers of each group and some KV heads of
//! each layer. [`WorkerChecksums::new`] decides once, at startup, whether it can checksum each
//! group, and records why not ([`SkipReason`]) instead of failing. Per request it turns the
//! scheduler's [`ChecksumRequest`] into [`GroupJob`]s for a [`ChecksumBackend`] and returns a
//! [`RequestRecord`].
//!
//! Invariants:
//! - head `h` of this rank is global head `head_offset + h`, plus `k * global_kv_heads` for the
//!   `k`-th cache (in name order) of one layer module that has several caches with one layer
//!   number; so every (layer number, global head) pair is one slice of the whole model and the
//!   parts of all workers add up to the definition;
//! - a producer sums replica 0 only; a consumer reports one part per replica key it holds;
//! - nothing here panics on a configuration: it becomes a skipped group.

use std::collections::BTreeMap;

use tandem_kv_cache::{
    spec::layer_number, BlockLayout, KvCacheConfig, KvCacheGroup, KvCacheSpec, KvStorage,
};

use crate::backend::{BlockJob, ChecksumBackend, LayerJob};
use crate::definition::{layer_fingerprint, pieces_per_token, MAX_KV_HEADS_PER_LAYER};
use crate::error::KvChecksumError;
use crate::incremental::IncrementalChecksum;
use crate::record::{GroupValues, ReplicaKey, RequestRecord, SkipReason, WorkerId};
use crate::schedule::{ChecksumRequest, ScheduledGroup};

/// Which side of a transfer a worker checksums for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Checksums what it sends: replica 0 of each layer only (every copy holds the same KV).
    Producer,
    /// Checksums what it loaded: every replica, since each copy arrived by its own transfer.
    Consumer,
}

/// How this TP rank's KV heads of a group map to the model's global heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadPlacement {
    /// Global index of this rank's first KV head.
    pub head_offset: u32,
    /// KV heads of one cache across the whole model.
    pub global_kv_heads: u32,
    /// Which copy of its heads this rank holds.
    pub replica: ReplicaKey,
}

impl HeadPlacement {
    /// One rank holding all `num_kv_heads` (TP 1).
    pub fn single(num_kv_heads: u32) -> Self {
        HeadPlacement {
            head_offset: 0,
            global_kv_heads: num_kv_heads,
            replica: ReplicaKey::SINGLE,
        }
    }

    /// KV heads split evenly across TP ranks; once TP exceeds the heads, each head is held by
    /// `tp_size / global_kv_heads` consecutive ranks (replicas).
    pub fn tp_sharded(
        tp_rank: u32,
        tp_size: u32,
        global_kv_heads: u32,
    ) -> Result<Self, KvChecksumError> {
        check_rank(tp_rank, tp_size, global_kv_heads)?;
        if global_kv_heads >= tp_size {
            if !global_kv_heads.is_multiple_of(tp_size) {
                return Err(KvChecksumError::InvalidPlacement(format!(
                    "{global_kv_heads} KV heads do not split across TP {tp_size}"
                )));
            }
            Ok(HeadPlacement {
                head_offset: tp_rank * (global_kv_heads / tp_size),
                global_kv_heads,
                replica: ReplicaKey::SINGLE,
            })
        } else {
            if !tp_size.is_multiple_of(global_kv_heads) {
                return Err(KvChecksumError::InvalidPlacement(format!(
                    "TP {tp_size} is not a multiple of {global_kv_heads} KV heads"
                )));
            }
            let replicas = tp_size / global_kv_heads;
            Ok(HeadPlacement {
                head_offset: tp_rank / replicas,
                global_kv_heads,
                replica: ReplicaKey {
                    replicas,
                    index: tp_rank % replicas,
                },
            })
        }
    }

    /// Every rank holds every head (MLA-type caches): `tp_size` replicas.
    pub fn replicated(
        tp_rank: u32,
        tp_size: u32,
        global_kv_heads: u32,
    ) -> Result<Self, KvChecksumError> {
        check_rank(tp_rank, tp_size, global_kv_heads)?;
        Ok(HeadPlacement {
            head_offset: 0,
            global_kv_heads,
            replica: ReplicaKey {
                replicas: tp_size,
                index: tp_rank,
            },
        })
    }
}

/// A rank inside its TP group, and a cache with at least one KV head.
fn check_rank(tp_rank: u32, tp_size: u32, global_kv_heads: u32) -> Result<(), KvChecksumError> {
    if tp_size == 0 || tp_rank >= tp_size || global_kv_heads == 0 {
        return Err(KvChecksumError::InvalidPlacement(format!(
            "rank {tp_rank} of TP {tp_size} with {global_kv_heads} KV heads"
        )));
    }
    Ok(())
}

/// One of this worker's caches (one layer's K and V) in a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheLayer {
    /// Index of the layer in the worker's KV memory.
    pub source_index: usize,
    /// The layer's name, e.g. `model.layers.3.self_attn`.
    pub name: String,
    pub layout: BlockLayout,
}

/// This worker's share of one KV cache group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerGroup {
    pub group_id: usize,
    pub spec: KvCacheSpec,
    /// This worker's caches of the group (none on a PP stage without its layers).
    pub layers: Vec<CacheLayer>,
    pub heads: HeadPlacement,
}

#[derive(Debug, Clone)]
pub(crate) struct ReadyGroup {
    pub(crate) block_size: usize,
    layers: Vec<(LayerJob, ReplicaKey)>,
}

impl ReadyGroup {
    /// The layers `role` sums, each with its output column, and the replica key of each column:
    /// a producer sums replica 0 only, a consumer every replica it holds.
    pub(crate) fn columns(&self, role: Role) -> (Vec<LayerJob>, Vec<ReplicaKey>) {
        let mut keys: Vec<ReplicaKey> = Vec::new();
        let mut layers = Vec::with_capacity(self.layers.len());
        for (job, key) in &self.layers {
            if role == Role::Producer && key.index != 0 {
                continue;
            }
            let column = match keys.iter().position(|k| k == key) {
                Some(c) => c,
                None => {
                    keys.push(*key);
                    keys.len() - 1
                }
            };
            layers.push(LayerJob {
                column,
                ..job.clone()
            });
        }
        (layers, keys)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct PreparedGroup {
    pub(crate) group_id: usize,
    pub(crate) fingerprint: u64,
    pub(crate) state: Result<ReadyGroup, SkipReason>,
}

/// A worker's checksum setup: decided once, used for every request.
#[derive(Debug, Clone)]
pub struct WorkerChecksums {
    worker: WorkerId,
    groups: Vec<PreparedGroup>,
}

impl WorkerChecksums {
    /// Prepares every group; groups that cannot be checksummed are recorded as skipped.
    pub fn new(worker: WorkerId, groups: Vec<WorkerGroup>) -> Self {
        let groups = groups
            .into_iter()
            .map(|g| PreparedGroup {
                group_id: g.group_id,
                fingerprint: g.layers.iter().fold(0u64, |f, l| {
                    f.wrapping_add(layer_fingerprint(
                        &l.name,
                        g.spec.type_name(),
                        g.spec.dtype(),
                    ))
                }),
                state: prepare(&g),
            })
            .collect();
        WorkerChecksums { worker, groups }
    }

    /// The groups of a worker's [`KvStorage`] (allocated from `config`), with each group's head
    /// placement from `placement`.
    pub fn from_storage(
        worker: WorkerId,
        storage: &KvStorage,
        config: &KvCacheConfig,
        placement: impl Fn(&KvCacheGroup) -> HeadPlacement,
    ) -> Self {
        let groups = config
            .groups
            .iter()
            .map(|g| WorkerGroup {
                group_id: g.group_id,
                spec: g.spec,
                layers: (0..storage.num_layers())
                    .filter(|&i| storage.layer_group(i) == g.group_id)
                    .map(|i| CacheLayer {
                        source_index: i,
                        name: storage.layer_name(i).to_owned(),
                        layout: storage.layout(i),
                    })
                    .collect(),
                heads: placement(g),
            })
            .collect();
        Self::new(worker, groups)
    }

    /// The only worker of an instance (TP 1, PP 1): every layer and every head of `config`'s
    /// groups in `storage`.
    pub fn single(storage: &KvStorage, config: &KvCacheConfig) -> Self {
        Self::from_storage(
            WorkerId {
                tp_rank: 0,
                pp_rank: 0,
            },
            storage,
            config,
            |g| HeadPlacement::single(g.spec.num_kv_heads() as u32),
        )
    }

    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// Groups this worker cannot checksum, and why (to log at startup).
    pub fn skipped_groups(&self) -> impl Iterator<Item = (usize, &SkipReason)> {
        self.groups
            .iter()
            .filter_map(|g| g.state.as_ref().err().map(|r| (g.group_id, r)))
    }

    /// This worker's fingerprint of a group (0 when it holds none of its layers).
    pub fn fingerprint(&self, group_id: usize) -> u64 {
        self.groups
            .iter()
            .find(|g| g.group_id == group_id)
            .map_or(0, |g| g.fingerprint)
    }

    /// Checksums one request's scheduled blocks. Never fails: a group the backend refuses is
    /// reported as [`crate::GroupOutcome::Failed`], which the scheduler treats as unverified.
    pub fn checksum(
        &self,
        backend: &dyn ChecksumBackend,
        role: Role,
        request: &ChecksumRequest,
    ) -> RequestRecord {
        IncrementalChecksum::new(self, role, request).finish(backend)
    }

    /// This worker's share of group `group_id`, if it holds any of its layers.
    pub(crate) fn group(&self, group_id: usize) -> Option<&PreparedGroup> {
        self.groups.iter().find(|g| g.group_id == group_id)
    }
}

pub(crate) fn values_shell(sg: &ScheduledGroup, num_tokens: usize) -> GroupValues {
    GroupValues {
        block_size: sg.block_size,
        start: sg.start,
        first_token: sg.first_token,
        num_tokens,
        blocks_digest: sg.digest(num_tokens),
        num_blocks: sg.block_ids.len(),
        parts: Vec::new(),
    }
}

/// The block jobs of a scheduled group: one per position, covering its tokens in
/// `[first_token, num_tokens)`.
pub(crate) fn block_jobs(
    sg: &ScheduledGroup,
    num_tokens: usize,
) -> Result<Vec<BlockJob>, KvChecksumError> {
    let bs = sg.block_size;
    sg.block_ids
        .iter()
        .enumerate()
        .map(|(i, &block_id)| {
            let begin_of = |pos: usize| pos.checked_mul(bs);
            let pos = sg.start.checked_add(i);
            let (Some(lo), Some(hi)) = (
                pos.and_then(begin_of),
                pos.and_then(|p| p.checked_add(1)).and_then(begin_of),
            ) else {
                return Err(KvChecksumError::InvalidJob(format!(
                    "position {} x block size {bs} overflows",
                    sg.start
                )));
            };
            let token_begin = lo.max(sg.first_token);
            let token_end = hi.min(num_tokens).max(token_begin);
            Ok(BlockJob {
                block_id,
                first_slot: token_begin - lo,
                token_begin,
                token_end,
            })
        })
        .collect()
}

/// The name up to and including its layer-number component (`model.layers.0.self_attn.attn` ->
/// `model.layers.0`): caches of one layer module share it.
fn module_prefix(name: &str) -> Option<&str> {
    let mut start = 0;
    for (i, c) in name
        .char_indices()
        .chain(std::iter::once((name.len(), '.')))
    {
        if matches!(c, '.' | '_' | '/') {
            if name[start..i].parse::<u32>().is_ok() {
                return Some(&name[..i]);
            }
            start = i + 1;
        }
    }
    None
}

fn prepare(g: &WorkerGroup) -> Result<ReadyGroup, SkipReason> {
    let spec = &g.spec;
    let mut numbered = Vec::with_capacity(g.layers.len());
    for l in &g.layers {
        let lay = &l.layout;
        if lay.kernel_block_size == 0 || lay.block_size % lay.kernel_block_size != 0 {
            return Err(SkipReason::KernelBlocksDoNotTile {
                layer: l.name.clone(),
            });
        }
        if lay.validate().is_err()
            || lay.block_size != spec.block_size()
            || lay.num_kv_heads != spec.num_kv_heads()
            || lay.head_dim != spec.head_dim()
            || lay.dtype != spec.dtype()
        {
            return Err(SkipReason::LayoutDiffersFromSpec {
                layer: l.name.clone(),
            });
        }
        if pieces_per_token(lay.head_dim, lay.dtype).is_none() {
            return Err(SkipReason::NotWholePieces {
                layer: l.name.clone(),
                bytes_per_token: 2 * lay.row_bytes(),
            });
        }
        let Some(number) = layer_number(&l.name) else {
            return Err(SkipReason::LayerWithoutNumber {
                layer: l.name.clone(),
            });
        };
        numbered.push((number, l));
    }

    // Caches sharing a layer number: consecutive head ranges if one module holds them all.
    let mut by_number: BTreeMap<u32, Vec<&CacheLayer>> = BTreeMap::new();
    for (n, l) in &numbered {
        by_number.entry(*n).or_default().push(l);
    }
    let heads = g.heads;
    let mut layers = Vec::with_capacity(numbered.len());
    for (number, mut caches) in by_number {
        let module = module_prefix(&caches[0].name);
        if caches.iter().any(|c| module_prefix(&c.name) != module) {
            return Err(SkipReason::DuplicateLayerNumber { number });
        }
        caches.sort_by(|a, b| a.name.cmp(&b.name));
        for (k, c) in caches.into_iter().enumerate() {
            let local = c.layout.num_kv_heads as u64;
            let base = (k as u64) * heads.global_kv_heads as u64 + heads.head_offset as u64;
            let in_model = heads.head_offset as u64 + local <= heads.global_kv_heads as u64;
            if !in_model || base + local > MAX_KV_HEADS_PER_LAYER || !heads.replica.is_valid() {
                return Err(SkipReason::HeadsOutOfRange {
                    layer: c.name.clone(),
                });
            }
            layers.push((
                LayerJob {
                    source_index: c.source_index,
                    layout: c.layout,
                    layer_number: number,
                    head_base: base as u32,
                    column: 0,
                },
                heads.replica,
            ));
        }
    }
    // Memory order helps the CPU backend's prefetching.
    layers.sort_by_key(|(j, _)| j.source_index);
    Ok(ReadyGroup {
        block_size: spec.block_size(),
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_prefix_ends_at_the_layer_number() {
        assert_eq!(
            module_prefix("model.layers.0.self_attn.attn"),
            Some("model.layers.0")
        );
        assert_eq!(module_prefix("mtp.layers.0.attn"), Some("mtp.layers.0"));
        assert_eq!(module_prefix("blk.12"), Some("blk.12"));
        assert_eq!(module_prefix("lm_head"), None);
    }

    #[test]
    fn tp_placement_shards_then_replicates() {
        let p = HeadPlacement::tp_sharded(3, 4, 8).unwrap();
        assert_eq!((p.head_offset, p.replica), (6, ReplicaKey::SINGLE));
        // TP4, 2 heads: ranks 0,1 hold head 0; ranks 2,3 hold head 1
        let p = HeadPlacement::tp_sharded(3, 4, 2).unwrap();
        assert_eq!(p.head_offset, 1);
        assert_eq!(
            p.replica,
            ReplicaKey {
                replicas: 2,
                index: 1
            }
        );
        assert!(HeadPlacement::tp_sharded(0, 3, 4).is_err());
        assert!(HeadPlacement::tp_sharded(4, 4, 8).is_err());
        let p = HeadPlacement::replicated(2, 4, 1).unwrap();
        assert_eq!(
            (p.head_offset, p.replica.replicas, p.replica.index),
            (0, 4, 2)
        );
    }
}
