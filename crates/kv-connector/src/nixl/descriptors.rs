//! Descriptor geometry: how (region, block) pairs of one side map to indices of a NIXL prepared
//! descriptor list, and the plan of one transfer (index lists, bytes, coalesced descriptors).
//!
//! A side's prepared list holds one descriptor per block of every region, regions in storage
//! order (layer 0 K, layer 0 V, layer 1 K, …): descriptor `offset[r] + b` is block `b` of region
//! `r`, at `addr[r] + b * block_stride[r]` (`block_stride == block_bytes` for a per-layer array; a
//! block-major device cache interleaves every layer's K and V of a block, so its stride is the
//! whole block's). Split into smaller units, descriptor `i` is unit `i % units` of block
//! `i / units`. Local and remote region `r` are the same (layer, part).
//!
//! A transfer's block ids come per KV cache group ([`BlockPairs`]): region `r` moves the pairs of
//! its layer's group (`RegionGeometry::group`, of the local side), or the one list every group
//! shares.
//!
//! Invariants of a [`TransferPlan`]: both index lists have the same length, pair `i` moves
//! `block_bytes[r]` bytes, destination blocks are distinct, and pairs are ordered by source
//! address, so that moves contiguous in memory on both sides sit together; [`TransferPlan::runs`]
//! merges them (in a block-major cache, every layer of a run of consecutive blocks is one run)
//! and [`TransferPlan::descriptors`] counts the runs, which is what a transfer posts when that is
//! fewer than the pairs (`transfer.rs`).

use std::collections::HashSet;

use super::pairing::UnitPairing;
use crate::error::KvConnectorError;

/// Which side of a transfer a block id belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Local,
    Remote,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// One layer's K or V array of one side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionGeometry {
    pub addr: usize,
    pub len: usize,
    /// Bytes of one descriptor (a block, or a unit of one when split).
    pub block_bytes: usize,
    /// Descriptors of the region.
    pub num_blocks: usize,
    /// The KV cache group of the region's layer (read on the local side only).
    pub group: usize,
    /// Bytes from one storage block's start to the next's.
    pub block_stride: usize,
    /// Descriptors per storage block (1 unless split).
    pub units: usize,
    /// The GPU holding the region (device memory), 0 for host memory.
    pub device: u64,
    /// The registered allocation holding the region: moves merge into one descriptor only
    /// within one allocation on each side (NIXL refuses a descriptor spanning two
    /// registrations, even where they happen to be adjacent). [`OWN_ALLOCATION`]: the region
    /// is an allocation of its own.
    pub allocation: u64,
}

/// [`RegionGeometry::allocation`] of a region known only to be its own allocation;
/// [`DescTable::new`] gives each such region a distinct id.
pub const OWN_ALLOCATION: u64 = u64::MAX;

impl RegionGeometry {
    /// A per-layer array: `num_blocks` blocks of `block_bytes` back to back.
    pub fn array(
        addr: usize,
        len: usize,
        block_bytes: usize,
        num_blocks: usize,
        group: usize,
    ) -> Self {
        RegionGeometry {
            addr,
            len,
            block_bytes,
            num_blocks,
            group,
            block_stride: block_bytes,
            units: 1,
            device: 0,
            allocation: OWN_ALLOCATION,
        }
    }

    /// Address of descriptor `i`.
    pub fn desc_addr(&self, i: usize) -> usize {
        self.addr + (i / self.units) * self.block_stride + (i % self.units) * self.block_bytes
    }

    /// The bytes the descriptors span from `addr`, or `None` when the geometry is inconsistent
    /// (zero sizes, units not filling whole blocks, units wider than the stride, overflow).
    fn span(&self) -> Option<usize> {
        if self.block_bytes == 0 || self.num_blocks == 0 || self.units == 0 {
            return None;
        }
        if !self.num_blocks.is_multiple_of(self.units) {
            return None;
        }
        let block = self.units.checked_mul(self.block_bytes)?;
        if block > self.block_stride {
            return None;
        }
        (self.num_blocks / self.units - 1)
            .checked_mul(self.block_stride)?
            .checked_add(block)
    }
}

/// The block ids of one transfer for one KV cache group: `local[i]` pairs with `remote[i]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupPairs {
    pub local: Vec<usize>,
    pub remote: Vec<usize>,
}

/// The block ids of one transfer: a [`GroupPairs`] per KV cache group (indexed by group id), or
/// one that every group shares (the engine runs one block table for all groups).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockPairs(Vec<GroupPairs>);

impl BlockPairs {
    /// One list of pairs for every group.
    pub fn shared(local: Vec<usize>, remote: Vec<usize>) -> Self {
        BlockPairs(vec![GroupPairs { local, remote }])
    }

    /// A list of pairs per group, `groups[g]` for group `g` (one entry: shared by all).
    pub fn per_group(groups: Vec<GroupPairs>) -> Self {
        if groups.is_empty() {
            return Self::shared(Vec::new(), Vec::new());
        }
        BlockPairs(groups)
    }

    pub fn groups(&self) -> &[GroupPairs] {
        &self.0
    }

    pub fn groups_mut(&mut self) -> &mut [GroupPairs] {
        &mut self.0
    }

    /// Pairs over every group.
    pub fn num_pairs(&self) -> usize {
        self.0.iter().map(|g| g.local.len()).sum()
    }

    /// The local block ids, a list per group (or the one list all groups share).
    pub fn local_lists(&self) -> Vec<Vec<usize>> {
        self.0.iter().map(|g| g.local.clone()).collect()
    }

    /// Cuts the pairs into at most `parts` transfers, each taking a consecutive share of every
    /// group's pairs (in their order, so runs that merge stay together); parts without pairs
    /// are left out. Every pair is in exactly one part. The whole is checked first as one
    /// transfer to `dest` would be (equal counts, no block written twice), so a split never
    /// hides what the whole would refuse.
    pub fn split(&self, parts: usize, dest: Side) -> Result<Vec<BlockPairs>, KvConnectorError> {
        self.check(dest)?;
        let parts = parts.max(1);
        Ok((0..parts)
            .map(|i| {
                BlockPairs(
                    self.0
                        .iter()
                        .map(|g| {
                            let n = g.local.len();
                            let (lo, hi) = (n * i / parts, n * (i + 1) / parts);
                            GroupPairs {
                                local: g.local[lo..hi].to_vec(),
                                remote: g.remote[lo..hi].to_vec(),
                            }
                        })
                        .collect(),
                )
            })
            .filter(|p| p.num_pairs() > 0)
            .collect())
    }

    /// Checks each group's lists (see [`plan_transfer`]).
    fn check(&self, dest: Side) -> Result<(), KvConnectorError> {
        self.0
            .iter()
            .try_for_each(|g| check_pairs(&g.local, &g.remote, dest))
    }

    /// Which of the lists the local region `r` (of `table`) moves: its group's.
    fn index_of_region(&self, table: &DescTable, r: usize) -> Result<usize, KvConnectorError> {
        let group = table.regions[r].group;
        match self.0.len() {
            1 => Ok(0),
            n if group < n => Ok(group),
            n => Err(KvConnectorError::InvalidRegions(format!(
                "region {r} belongs to KV cache group {group}, but the transfer names {n} groups"
            ))),
        }
    }
}

/// The regions of one side, and where each starts in its prepared descriptor list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescTable {
    regions: Vec<RegionGeometry>,
    offsets: Vec<usize>,
    total: usize,
}

impl DescTable {
    pub fn new(mut regions: Vec<RegionGeometry>) -> Result<Self, KvConnectorError> {
        if regions.is_empty() {
            return Err(KvConnectorError::InvalidRegions("no regions".into()));
        }
        for (i, r) in regions.iter_mut().enumerate() {
            if r.allocation == OWN_ALLOCATION {
                // Above any id a caller gives (those are u32): distinct from all of them.
                r.allocation = (1 << 63) | i as u64;
            }
        }
        let mut offsets = Vec::with_capacity(regions.len());
        let mut total = 0usize;
        for (i, r) in regions.iter().enumerate() {
            let Some(span) = r.span() else {
                return Err(KvConnectorError::InvalidRegions(format!(
                    "region {i}: {} blocks of {} bytes in units of {} at a stride of {} do not \
                     make a layout",
                    r.num_blocks, r.block_bytes, r.units, r.block_stride
                )));
            };
            if span > r.len {
                return Err(KvConnectorError::InvalidRegions(format!(
                    "region {i}: {} bytes cannot hold {} blocks of {} bytes at a stride of {}",
                    r.len, r.num_blocks, r.block_bytes, r.block_stride
                )));
            }
            offsets.push(total);
            total += r.num_blocks;
        }
        if total > i32::MAX as usize {
            return Err(KvConnectorError::InvalidRegions(format!(
                "{total} block descriptors exceed NIXL's i32 index range"
            )));
        }
        Ok(DescTable {
            regions,
            offsets,
            total,
        })
    }

    /// The same memory cut into blocks `ratio` times smaller (block `b` becomes sub-blocks
    /// `b * ratio .. (b + 1) * ratio`): how a side with larger blocks pairs with a peer's
    /// smaller ones. Needs every block's bytes to divide by `ratio`.
    pub fn split(&self, ratio: usize) -> Result<DescTable, KvConnectorError> {
        if ratio == 0 || self.regions.iter().any(|r| r.block_bytes % ratio != 0) {
            return Err(KvConnectorError::InvalidRegions(format!(
                "blocks cannot be split in {ratio}"
            )));
        }
        DescTable::new(
            self.regions
                .iter()
                .map(|r| RegionGeometry {
                    block_bytes: r.block_bytes / ratio,
                    num_blocks: r.num_blocks * ratio,
                    units: r.units * ratio,
                    ..*r
                })
                .collect(),
        )
    }

    pub fn regions(&self) -> &[RegionGeometry] {
        &self.regions
    }

    /// Number of descriptors in the prepared list.
    pub fn len(&self) -> usize {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The blocks of the side: the smallest `num_blocks` over its regions.
    pub fn num_blocks(&self) -> usize {
        self.regions.iter().map(|r| r.num_blocks).min().unwrap_or(0)
    }

    /// Every descriptor `(addr, len)` in list order.
    pub fn descriptors(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.regions
            .iter()
            .flat_map(|r| (0..r.num_blocks).map(move |b| (r.desc_addr(b), r.block_bytes)))
    }

    fn index(&self, region: usize, block: usize) -> i32 {
        (self.offsets[region] + block) as i32
    }

    /// Address of descriptor `block` of `region`.
    fn addr(&self, region: usize, block: usize) -> usize {
        self.regions[region].desc_addr(block)
    }

    /// Checks that the other side's regions pair with ours one to one with equal block sizes.
    pub fn check_pairs_with(&self, other: &DescTable) -> Result<(), KvConnectorError> {
        if self.regions.len() != other.regions.len() {
            return Err(KvConnectorError::InvalidRegions(format!(
                "{} local regions but {} remote regions",
                self.regions.len(),
                other.regions.len()
            )));
        }
        for (i, (a, b)) in self.regions.iter().zip(&other.regions).enumerate() {
            if a.block_bytes != b.block_bytes {
                return Err(KvConnectorError::InvalidRegions(format!(
                    "region {i}: local blocks of {} bytes, remote blocks of {} bytes",
                    a.block_bytes, b.block_bytes
                )));
            }
        }
        Ok(())
    }
}

/// What one transfer moves, as indices into the two prepared lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferPlan {
    pub local_indices: Vec<i32>,
    pub remote_indices: Vec<i32>,
    /// Bytes moved (one direction).
    pub bytes: u64,
    /// Block pairs named, over every group (each moves in every region of its group).
    pub blocks: usize,
    /// Runs of moves contiguous on both sides, in plan order: what a transfer posts as its
    /// descriptors where that is fewer than the indices (`descriptors == runs.len()`).
    pub runs: Vec<Run>,
    /// Descriptors once runs contiguous on both sides are merged.
    pub descriptors: usize,
}

/// Bytes contiguous on both sides: `len` bytes at `local` and at `remote` (device addresses on
/// GPU `*_device` for device memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub local: usize,
    pub remote: usize,
    pub len: usize,
    pub local_device: u64,
    pub remote_device: u64,
}

/// The id lists pair one to one, and the destination side's ids are distinct (two sources into
/// one block would race).
fn check_pairs(
    local_ids: &[usize],
    remote_ids: &[usize],
    dest: Side,
) -> Result<(), KvConnectorError> {
    if local_ids.len() != remote_ids.len() {
        return Err(KvConnectorError::BlockCountMismatch {
            local: local_ids.len(),
            remote: remote_ids.len(),
        });
    }
    let dest_ids = match dest {
        Side::Local => local_ids,
        Side::Remote => remote_ids,
    };
    let mut seen = HashSet::with_capacity(dest_ids.len());
    match dest_ids.iter().find(|&&b| !seen.insert(b)) {
        Some(&block) => Err(KvConnectorError::DuplicateBlock { side: dest, block }),
        None => Ok(()),
    }
}

fn check_ids(ids: &[usize], num_blocks: usize, side: Side) -> Result<(), KvConnectorError> {
    match ids.iter().find(|&&b| b >= num_blocks) {
        Some(&block) => Err(KvConnectorError::BlockOutOfRange {
            side,
            block,
            num_blocks,
        }),
        None => Ok(()),
    }
}

/// Plans moving, in every region, blocks `remote[i]` ⇄ `local[i]` of the region's group in
/// `ids`. `dest` is the side written to (local for a READ, remote for a WRITE); its ids must be
/// distinct within a group. Ids are checked against each region's blocks (groups' pools differ).
pub fn plan_transfer(
    local: &DescTable,
    remote: &DescTable,
    ids: &BlockPairs,
    dest: Side,
) -> Result<TransferPlan, KvConnectorError> {
    ids.check(dest)?;
    local.check_pairs_with(remote)?;
    let mut plan = TransferPlan {
        local_indices: Vec::new(),
        remote_indices: Vec::new(),
        bytes: 0,
        blocks: ids.num_pairs(),
        runs: Vec::new(),
        descriptors: 0,
    };
    let mut moves = Vec::with_capacity(ids.num_pairs() * local.regions.len());
    for (r, region) in local.regions.iter().enumerate() {
        let g = ids.index_of_region(local, r)?;
        let group = &ids.groups()[g];
        check_ids(&group.local, region.num_blocks, Side::Local)?;
        check_ids(&group.remote, remote.regions[r].num_blocks, Side::Remote)?;
        for (&l, &rm) in group.local.iter().zip(&group.remote) {
            moves.push(Move {
                local: (local.index(r, l), local.addr(r, l)),
                remote: (remote.index(r, rm), remote.addr(r, rm)),
                bytes: region.block_bytes,
                spaces: (
                    (region.device, region.allocation),
                    (remote.regions[r].device, remote.regions[r].allocation),
                ),
            });
        }
    }
    finish_plan(&mut plan, moves, dest);
    Ok(plan)
}

/// One descriptor pair of a plan: (index, address) on each side.
#[derive(Debug, Clone, Copy)]
struct Move {
    local: (i32, usize),
    remote: (i32, usize),
    bytes: usize,
    /// (device, allocation) of the local and of the remote side.
    spaces: ((u64, u64), (u64, u64)),
}

/// Orders `moves` by source address (runs contiguous on both sides then sit together, and NIXL
/// merges each into one descriptor) and fills `plan`'s lists, bytes and merged descriptor count.
fn finish_plan(plan: &mut TransferPlan, mut moves: Vec<Move>, dest: Side) {
    match dest {
        Side::Local => moves.sort_unstable_by_key(|m| (m.remote.1, m.local.1)),
        Side::Remote => moves.sort_unstable_by_key(|m| (m.local.1, m.remote.1)),
    }
    plan.local_indices.reserve(moves.len());
    plan.remote_indices.reserve(moves.len());
    // The (device, allocation) pair of the last run: a run never leaves its allocations.
    let mut last_spaces = None;
    for m in moves {
        plan.local_indices.push(m.local.0);
        plan.remote_indices.push(m.remote.0);
        plan.bytes += m.bytes as u64;
        let ((local_device, _), (remote_device, _)) = m.spaces;
        match plan.runs.last_mut() {
            Some(r)
                if r.local + r.len == m.local.1
                    && r.remote + r.len == m.remote.1
                    && last_spaces == Some(m.spaces) =>
            {
                r.len += m.bytes
            }
            _ => plan.runs.push(Run {
                local: m.local.1,
                remote: m.remote.1,
                len: m.bytes,
                local_device,
                remote_device,
            }),
        }
        last_spaces = Some(m.spaces);
    }
    plan.descriptors = plan.runs.len();
}

/// Plans a transfer at unit grain ([`UnitPairing`]): `local` is our table split into
/// `pairing.local_units()` units per block, `remote` the peer's split into
/// `pairing.remote_units`. Ids are as in [`plan_transfer`], per the local region's group: a
/// local id (in the peer's block size) is sub-block `id % ratio` of our block `id / ratio`.
pub fn plan_unit_transfer(
    local: &DescTable,
    remote: &DescTable,
    pairing: &UnitPairing,
    ids: &BlockPairs,
    dest: Side,
) -> Result<TransferPlan, KvConnectorError> {
    ids.check(dest)?;
    let (k, lu, ru) = (pairing.ratio, pairing.local_units(), pairing.remote_units);
    let mut moves = Vec::new();
    for m in &pairing.maps {
        let (lr, rr) = (
            local.regions.get(m.local_region),
            remote.regions.get(m.remote_region),
        );
        let (Some(lr), Some(rr)) = (lr, rr) else {
            return Err(KvConnectorError::InvalidRegions(format!(
                "unit map {m:?} names a region outside the tables"
            )));
        };
        if lr.block_bytes != rr.block_bytes {
            return Err(KvConnectorError::InvalidRegions(format!(
                "local region {} units of {} bytes, remote region {} units of {} bytes",
                m.local_region, lr.block_bytes, m.remote_region, rr.block_bytes
            )));
        }
        let group = &ids.groups()[ids.index_of_region(local, m.local_region)?];
        check_ids(&group.local, lr.num_blocks / lu * k, Side::Local)?;
        check_ids(&group.remote, rr.num_blocks / ru, Side::Remote)?;
        for (&l, &r) in group.local.iter().zip(&group.remote) {
            let local_unit = (l / k) * lu + m.local_head * k + l % k;
            let remote_unit = r * ru + m.remote_unit;
            moves.push(Move {
                local: (
                    local.index(m.local_region, local_unit),
                    local.addr(m.local_region, local_unit),
                ),
                remote: (
                    remote.index(m.remote_region, remote_unit),
                    remote.addr(m.remote_region, remote_unit),
                ),
                bytes: lr.block_bytes,
                spaces: ((lr.device, lr.allocation), (rr.device, rr.allocation)),
            });
        }
    }
    let mut plan = TransferPlan {
        local_indices: Vec::new(),
        remote_indices: Vec::new(),
        bytes: 0,
        blocks: ids.num_pairs(),
        runs: Vec::new(),
        descriptors: 0,
    };
    finish_plan(&mut plan, moves, dest);
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(num_regions: usize, num_blocks: usize, block_bytes: usize) -> DescTable {
        DescTable::new(
            (0..num_regions)
                .map(|i| {
                    RegionGeometry::array(
                        0x10000 * (i + 1),
                        num_blocks * block_bytes,
                        block_bytes,
                        num_blocks,
                        0,
                    )
                })
                .collect(),
        )
        .unwrap()
    }

    fn pairs(local: &[usize], remote: &[usize]) -> BlockPairs {
        BlockPairs::shared(local.to_vec(), remote.to_vec())
    }

    #[test]
    fn each_region_moves_its_groups_pairs_within_its_groups_blocks() {
        // Layer 0 (regions 0, 1) in group 0 with 8 blocks, layer 1 (regions 2, 3) in group 1
        // with 3: a sliding-window group's smaller pool.
        let side = |base: usize| {
            DescTable::new(
                [(0, 8), (0, 8), (1, 3), (1, 3)]
                    .iter()
                    .enumerate()
                    .map(|(i, &(group, num_blocks))| {
                        RegionGeometry::array(
                            base + 0x1000 * i,
                            num_blocks * 16,
                            16,
                            num_blocks,
                            group,
                        )
                    })
                    .collect(),
            )
            .unwrap()
        };
        let (local, remote) = (side(0x10000), side(0x90000));
        let ids = BlockPairs::per_group(vec![
            GroupPairs {
                local: vec![5, 6, 7],
                remote: vec![1, 2, 3],
            },
            GroupPairs {
                local: vec![2],
                remote: vec![0],
            },
        ]);
        let p = plan_transfer(&local, &remote, &ids, Side::Local).unwrap();
        assert_eq!(p.bytes, (3 + 3 + 1 + 1) * 16);
        assert_eq!(p.blocks, 4);
        assert_eq!(p.descriptors, 4);
        assert_eq!(
            p.local_indices,
            [5, 6, 7, 8 + 5, 8 + 6, 8 + 7, 16 + 2, 16 + 3 + 2]
        );
        assert_eq!(p.remote_indices, [1, 2, 3, 9, 10, 11, 16, 16 + 3]);
        // A full-group id beyond the sliding pool is fine in group 0, out of range in group 1.
        let over = BlockPairs::per_group(vec![
            GroupPairs {
                local: vec![5],
                remote: vec![6],
            },
            GroupPairs {
                local: vec![5],
                remote: vec![0],
            },
        ]);
        assert!(matches!(
            plan_transfer(&local, &remote, &over, Side::Local),
            Err(KvConnectorError::BlockOutOfRange {
                side: Side::Local,
                block: 5,
                num_blocks: 3
            })
        ));
        // One shared list moves in every region; a list per group must name every group.
        let shared = plan_transfer(&local, &remote, &pairs(&[1], &[2]), Side::Local).unwrap();
        assert_eq!(shared.local_indices, [1, 9, 17, 20]);
        let one_of_two = BlockPairs::per_group(vec![GroupPairs::default(); 1]);
        assert!(plan_transfer(&local, &remote, &one_of_two, Side::Local).is_ok());
        let three = BlockPairs::per_group(vec![GroupPairs::default(); 3]);
        assert!(plan_transfer(&local, &remote, &three, Side::Local).is_ok());
        let local_one_group = DescTable::new(
            (0..4)
                .map(|i| RegionGeometry::array(0x10000 * (i + 1), 8 * 16, 16, 8, i / 2 * 2))
                .collect(),
        )
        .unwrap();
        assert!(matches!(
            plan_transfer(&local_one_group, &remote, &ids, Side::Local),
            Err(KvConnectorError::InvalidRegions(_))
        ));
    }

    #[test]
    fn indices_address_each_region_and_block() {
        let t = table(3, 4, 16);
        assert_eq!(t.len(), 12);
        let d: Vec<_> = t.descriptors().collect();
        assert_eq!(d[0], (0x10000, 16));
        assert_eq!(d[5], (0x20000 + 16, 16));
        assert_eq!(t.index(2, 3), 11);
    }

    #[test]
    fn consecutive_runs_count_as_one_descriptor_per_region() {
        let local = table(4, 8, 16);
        let remote = table(4, 10, 16);
        // Two runs: remote 2,3,4 -> local 5,6,7 and remote 9 -> local 0, given scrambled.
        let p = plan_transfer(
            &local,
            &remote,
            &pairs(&[6, 0, 5, 7], &[3, 9, 2, 4]),
            Side::Local,
        )
        .unwrap();
        assert_eq!(p.blocks, 4);
        assert_eq!(p.descriptors, 2 * 4);
        assert_eq!(p.bytes, 4 * 4 * 16);
        assert_eq!(&p.local_indices[..4], &[5, 6, 7, 0]);
        assert_eq!(&p.remote_indices[..4], &[2, 3, 4, 9]);
        assert_eq!(p.local_indices[4], 8 + 5);
        assert_eq!(p.remote_indices[4], 10 + 2);
    }

    #[test]
    fn unit_plans_read_each_head_from_its_region() {
        use crate::nixl::pairing::UnitMap;
        // local: 2 regions (K, V) of 4 blocks of 3 heads x 16 bytes; remote: 3 ranks x (K, V),
        // 1 head each, 6 blocks of 16 bytes
        let local = table(2, 4, 48).split(3).unwrap();
        let remote = table(6, 6, 16);
        let maps = (0..3)
            .flat_map(|h| {
                [0, 1].map(|part| UnitMap {
                    local_region: part,
                    local_head: h,
                    remote_region: 2 * h + part,
                    remote_unit: 0,
                })
            })
            .collect();
        let pairing = UnitPairing {
            ratio: 1,
            local_heads: 3,
            remote_units: 1,
            maps,
        };
        let p = plan_unit_transfer(
            &local,
            &remote,
            &pairing,
            &pairs(&[2, 3], &[4, 5]),
            Side::Local,
        )
        .unwrap();
        assert_eq!(p.bytes, 2 * 2 * 3 * 16);
        assert_eq!(p.local_indices.len(), 12);
        // head 1 of local block 2 (K) <- rank 1's K (region 2) block 4
        let i = p
            .remote_indices
            .iter()
            .position(|&r| r == remote.index(2, 4))
            .unwrap();
        assert_eq!(p.local_indices[i], local.index(0, 2 * 3 + 1));
        // consecutive blocks 4,5 on the peer land in units 2*3+h, 3*3+h: not consecutive locally
        assert_eq!(p.descriptors, 12);
        assert!(
            plan_unit_transfer(&local, &remote, &pairing, &pairs(&[4], &[0]), Side::Local).is_err()
        );
        assert!(
            plan_unit_transfer(&local, &remote, &pairing, &pairs(&[0], &[6]), Side::Local).is_err()
        );
        assert!(plan_unit_transfer(
            &local,
            &remote,
            &pairing,
            &pairs(&[1, 1], &[0, 2]),
            Side::Local
        )
        .is_err());
    }

    #[test]
    fn bad_ids_are_errors() {
        let local = table(2, 8, 16);
        let remote = table(2, 4, 16);
        assert!(matches!(
            plan_transfer(&local, &remote, &pairs(&[1], &[1, 2]), Side::Local),
            Err(KvConnectorError::BlockCountMismatch {
                local: 1,
                remote: 2
            })
        ));
        assert!(matches!(
            plan_transfer(&local, &remote, &pairs(&[1], &[4]), Side::Local),
            Err(KvConnectorError::BlockOutOfRange {
                side: Side::Remote,
                block: 4,
                num_blocks: 4
            })
        ));
        assert!(matches!(
            plan_transfer(&local, &remote, &pairs(&[1, 1], &[0, 2]), Side::Local),
            Err(KvConnectorError::DuplicateBlock {
                side: Side::Local,
                block: 1
            })
        ));
        // A table split in two pairs with blocks of half the size.
        let split = table(2, 8, 32).split(2).unwrap();
        assert_eq!(
            (split.num_blocks(), split.regions()[0].block_bytes),
            (16, 16)
        );
        assert_eq!(split.descriptors().nth(3), Some((0x10000 + 48, 16)));
        plan_transfer(&split, &local, &pairs(&[3], &[1]), Side::Local).unwrap();
        assert!(table(1, 2, 30).split(4).is_err());
        // Reading one remote block into two local blocks is fine.
        plan_transfer(&local, &remote, &pairs(&[1, 2], &[0, 0]), Side::Local).unwrap();
        assert!(plan_transfer(&local, &table(2, 8, 32), &pairs(&[1], &[1]), Side::Local).is_err());
    }

    #[test]
    fn runs_never_span_two_allocations_even_when_adjacent() {
        // Two arrays of 4 blocks of 16 bytes, the second right after the first, on both sides:
        // block 3 of the first and block 0 of the second touch in memory on both sides.
        let side = |base: usize, allocations: [u64; 2]| {
            DescTable::new(
                (0..2)
                    .map(|r| RegionGeometry {
                        allocation: allocations[r],
                        ..RegionGeometry::array(base + r * 64, 64, 16, 4, 0)
                    })
                    .collect(),
            )
            .unwrap()
        };
        let ids = pairs(&[3, 0], &[3, 0]);
        let apart = plan_transfer(
            &side(0x1000, [OWN_ALLOCATION; 2]),
            &side(0x9000, [7, 8]),
            &ids,
            Side::Local,
        )
        .unwrap();
        assert_eq!(apart.descriptors, 4, "{:?}", apart.runs);
        let together = plan_transfer(
            &side(0x1000, [0, 0]),
            &side(0x9000, [7, 7]),
            &ids,
            Side::Local,
        )
        .unwrap();
        assert_eq!(together.descriptors, 3, "{:?}", together.runs);
        assert_eq!(
            (together.runs[1].local, together.runs[1].len),
            (0x1000 + 48, 32)
        );
    }

    /// A block-major side: `layers` layers whose K and V of block `b` sit together, every
    /// layer of a block contiguous (`[block][layer][K, V][bb]`), `blocks` blocks.
    fn block_major(base: usize, layers: usize, blocks: usize, bb: usize) -> DescTable {
        let stride = 2 * layers * bb;
        DescTable::new(
            (0..2 * layers)
                .map(|r| RegionGeometry {
                    block_stride: stride,
                    allocation: 0,
                    ..RegionGeometry::array(base + r * bb, blocks * stride - r * bb, bb, blocks, 0)
                })
                .collect(),
        )
        .unwrap()
    }

    #[test]
    fn block_major_runs_of_blocks_merge_across_layers() {
        let (local, remote) = (
            block_major(0x100000, 3, 8, 64),
            block_major(0x900000, 3, 6, 64),
        );
        assert_eq!(local.regions()[1].desc_addr(2), 0x100000 + 2 * 6 * 64 + 64);
        // Remote 1, 2, 3 -> local 4, 5, 6 is one run of three whole blocks; 5 -> 0 another.
        let p = plan_transfer(
            &local,
            &remote,
            &pairs(&[5, 0, 4, 6], &[2, 5, 1, 3]),
            Side::Local,
        )
        .unwrap();
        assert_eq!(p.bytes, 4 * 6 * 64);
        assert_eq!(p.descriptors, 2);
        // Source order: remote block 1's six parts first, layer by layer.
        assert_eq!(
            p.remote_indices[..2],
            [remote.index(0, 1), remote.index(1, 1)]
        );
        assert_eq!(p.local_indices[..2], [local.index(0, 4), local.index(1, 4)]);
        // Blocks consecutive on one side only: one descriptor per block (its layers merge).
        let p = plan_transfer(&local, &remote, &pairs(&[1, 3], &[2, 3]), Side::Local).unwrap();
        assert_eq!(p.descriptors, 2);
        // Split in two, the units still tile memory in order.
        let split = local.split(2).unwrap();
        assert_eq!(
            split.regions()[2].desc_addr(3),
            0x100000 + 6 * 64 + 2 * 64 + 32
        );
        assert_eq!(split.num_blocks(), 16);
        // A stride shorter than a block is no layout.
        let bad = RegionGeometry {
            block_stride: 32,
            ..RegionGeometry::array(0, 1 << 20, 64, 4, 0)
        };
        assert!(DescTable::new(vec![bad]).is_err());
        // A region too short for its last block is refused.
        let short = RegionGeometry {
            block_stride: 128,
            ..RegionGeometry::array(0, 3 * 128 + 63, 64, 4, 0)
        };
        assert!(DescTable::new(vec![short]).is_err());
    }
}
