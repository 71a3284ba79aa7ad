//! Which bytes of a peer's KV land in which of ours when the two instances split the model
//! differently (tensor or pipeline parallelism, replicated KV heads, block sizes).
//!
//! Each side describes its memory as regions (one per layer of every rank, K then V), each
//! naming its model layer and the model's KV heads it holds ([`LayerInfo::kv_heads`]). Two sides
//! with the same regions in the same order pair region to region, whole blocks
//! ([`Pairing::Regions`]). Otherwise ([`Pairing::Units`]) every local (layer, head) is looked up
//! among the peer's regions (replica 0 first), and blocks are cut into *units*:
//! - head-major caches (`[heads, tokens, head_dim]` per block): a unit is one head's rows of
//!   one peer-sized sub-block, so any head split pairs;
//! - token-major caches: a unit is a whole peer-sized sub-block, so the heads of paired regions
//!   must be the same (different pipeline splits with one TP layout).
//!
//! Invariants: every local region's every head is covered by exactly one link (so a READ fills
//! every byte of the destination blocks); linked units have the same size; the local side's
//! blocks are a whole multiple of the peer's (the side that moves the bytes has the larger ones).

use std::collections::HashMap;

use super::handshake::{HandshakeMismatch, LayerInfo};

/// How our regions pair with a peer's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pairing {
    /// Region `i` with region `i`, whole blocks (in the peer's units when `ratio > 1`).
    Regions,
    /// Finer units: see [`UnitPairing`].
    Units(UnitPairing),
}

/// Unit geometry of a pairing: the local side's blocks are cut into `local_units` units
/// (`local_heads` head slices of `ratio` sub-blocks each), the peer's into `remote_units`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitPairing {
    pub ratio: usize,
    /// Head slices per local block (1 for token-major units).
    pub local_heads: usize,
    /// Units per remote block (its heads for head-major units, else 1).
    pub remote_units: usize,
    pub maps: Vec<UnitMap>,
}

impl UnitPairing {
    /// Units per local block.
    pub fn local_units(&self) -> usize {
        self.local_heads * self.ratio
    }
    /// Distinct peer regions read (or written).
    pub fn remote_regions(&self) -> usize {
        let mut r: Vec<usize> = self.maps.iter().map(|m| m.remote_region).collect();
        r.sort_unstable();
        r.dedup();
        r.len()
    }
}

/// One local region's head slice `local_head`, linked to head unit `remote_unit` of the peer's
/// region `remote_region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitMap {
    pub local_region: usize,
    pub local_head: usize,
    pub remote_region: usize,
    pub remote_unit: usize,
}

const HEAD_MAJOR: &str = "head_major";

/// The model heads of a layer description (all of `0..num_kv_heads` when the peer did not say).
fn heads(l: &LayerInfo) -> Vec<u32> {
    if l.kv_heads.is_empty() {
        (0..l.num_kv_heads as u32).collect()
    } else {
        l.kv_heads.clone()
    }
}

/// Pairs our layers (`local`, blocks of `local_bs` tokens) with a peer's (`remote`, `remote_bs`),
/// where `local_bs` is a multiple of `remote_bs`. The first thing that cannot pair is the error.
pub fn pair_layers(
    local: &[LayerInfo],
    remote: &[LayerInfo],
    local_bs: usize,
    remote_bs: usize,
) -> Result<Pairing, HandshakeMismatch> {
    let mismatch = |layer: usize, field: &'static str, ours: String, theirs: String| {
        HandshakeMismatch::Layout {
            layer,
            field,
            ours,
            theirs,
        }
    };
    if remote_bs == 0 || !local_bs.is_multiple_of(remote_bs) {
        return Err(HandshakeMismatch::BlockSizeDirection {
            ours: local_bs,
            theirs: remote_bs,
        });
    }
    let ratio = local_bs / remote_bs;
    let same_regions = local.len() == remote.len()
        && local
            .iter()
            .zip(remote)
            .all(|(a, b)| a.name == b.name && heads(a) == heads(b));
    if same_regions && ratio == 1 {
        return Ok(Pairing::Regions);
    }
    // Where each (layer name, model head) lives on the peer: replica 0 first, then rank order.
    let mut holders: HashMap<(&str, u32), (usize, usize, u32)> = HashMap::new();
    for (i, l) in remote.iter().enumerate() {
        for (unit, &h) in heads(l).iter().enumerate() {
            let entry = holders
                .entry((l.name.as_str(), h))
                .or_insert((i, unit, l.kv_replica));
            if l.kv_replica < entry.2 {
                *entry = (i, unit, l.kv_replica);
            }
        }
    }
    let all_head_major = local
        .iter()
        .chain(remote)
        .all(|l| l.order == HEAD_MAJOR && l.kernel_block_size == l.block_size);
    let local_heads = if all_head_major {
        local.iter().map(|l| l.num_kv_heads).max().unwrap_or(1)
    } else {
        1
    };
    let remote_units = if all_head_major {
        remote.iter().map(|l| l.num_kv_heads).max().unwrap_or(1)
    } else {
        1
    };
    let mut maps = Vec::new();
    for (li, l) in local.iter().enumerate() {
        let want = heads(l);
        if all_head_major && l.num_kv_heads != local_heads {
            return Err(mismatch(
                li,
                "num_kv_heads",
                l.num_kv_heads.to_string(),
                "the same on every rank".into(),
            ));
        }
        for (local_head, h) in want.iter().enumerate() {
            let Some(&(ri, unit, _)) = holders.get(&(l.name.as_str(), *h)) else {
                return Err(mismatch(
                    li,
                    "kv_heads",
                    format!("{} head {h}", l.name),
                    "held by no peer rank".into(),
                ));
            };
            let r = &remote[ri];
            if all_head_major && r.num_kv_heads != remote_units {
                return Err(mismatch(
                    li,
                    "num_kv_heads",
                    "the same on every peer rank".into(),
                    r.num_kv_heads.to_string(),
                ));
            }
            for (field, o, t) in [
                ("head_dim", l.head_dim.to_string(), r.head_dim.to_string()),
                ("dtype", l.dtype.clone(), r.dtype.clone()),
            ] {
                if o != t {
                    return Err(mismatch(li, field, o, t));
                }
            }
            if all_head_major {
                maps.push(UnitMap {
                    local_region: 2 * li,
                    local_head,
                    remote_region: 2 * ri,
                    remote_unit: unit,
                });
                maps.push(UnitMap {
                    local_region: 2 * li + 1,
                    local_head,
                    remote_region: 2 * ri + 1,
                    remote_unit: unit,
                });
            } else if local_head == 0 {
                // Whole sub-blocks: the peer's region must hold exactly our heads, same order.
                if heads(r) != want || r.order != l.order {
                    return Err(mismatch(
                        li,
                        "kv_heads",
                        format!("{want:?} ({})", l.order),
                        format!(
                            "{:?} ({}): different head splits pair only with \
                             --kv-cache-layout head_major on both sides",
                            heads(r),
                            r.order
                        ),
                    ));
                }
                maps.push(UnitMap {
                    local_region: 2 * li,
                    local_head: 0,
                    remote_region: 2 * ri,
                    remote_unit: 0,
                });
                maps.push(UnitMap {
                    local_region: 2 * li + 1,
                    local_head: 0,
                    remote_region: 2 * ri + 1,
                    remote_unit: 0,
                });
            }
        }
    }
    Ok(Pairing::Units(UnitPairing {
        ratio,
        local_heads,
        remote_units,
        maps,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nixl::handshake::RegionInfo;
    use tandem_kv_cache::{BlockLayout, CacheDtype, LayoutOrder};

    /// One rank's layers `layers` with model heads `kv_heads` (replica `replica`).
    fn rank(
        layers: std::ops::Range<usize>,
        kv_heads: &[u32],
        replica: u32,
        bs: usize,
        order: LayoutOrder,
    ) -> Vec<LayerInfo> {
        layers
            .map(|i| {
                let layout = BlockLayout {
                    order,
                    ..BlockLayout::token_major(8, bs, kv_heads.len(), 4, CacheDtype::F32)
                };
                let region = RegionInfo {
                    addr: 0x1000,
                    len: layout.total_bytes() as u64,
                };
                let mut l = LayerInfo::new(
                    &format!("model.layers.{i}.self_attn"),
                    &layout,
                    region,
                    region,
                );
                l.kv_heads = kv_heads.to_vec();
                l.kv_replica = replica;
                l
            })
            .collect()
    }

    const HM: LayoutOrder = LayoutOrder::HeadMajor;
    const TM: LayoutOrder = LayoutOrder::TokenMajor;

    #[test]
    fn the_same_layout_pairs_region_to_region() {
        let a = rank(0..4, &[0, 1, 2], 0, 16, TM);
        assert_eq!(pair_layers(&a, &a, 16, 16), Ok(Pairing::Regions));
    }

    #[test]
    fn tp1_reads_each_head_from_the_tp3_rank_holding_it() {
        let local = rank(0..2, &[0, 1, 2], 0, 16, HM);
        let remote: Vec<_> = (0..3).flat_map(|r| rank(0..2, &[r], 0, 16, HM)).collect();
        let Pairing::Units(p) = pair_layers(&local, &remote, 16, 16).unwrap() else {
            panic!()
        };
        assert_eq!((p.local_units(), p.remote_units), (3, 1));
        // local layer 1 V (region 3), head 2 <- rank 2's layer 1 V: remote layer index 2*2+1
        assert!(p.maps.contains(&UnitMap {
            local_region: 3,
            local_head: 2,
            remote_region: 2 * 5 + 1,
            remote_unit: 0
        }));
        assert_eq!(p.maps.len(), 2 * 2 * 3);
        assert_eq!(p.remote_regions(), 12);
    }

    #[test]
    fn replicated_peer_heads_are_read_from_replica_0() {
        // peer TP 4 with 2 KV heads: ranks 0,1 hold head 0 (replicas 0,1), ranks 2,3 head 1
        let remote: Vec<_> = (0..4u32)
            .flat_map(|r| rank(0..1, &[r / 2], r % 2, 16, HM))
            .collect();
        let local = rank(0..1, &[0, 1], 0, 16, HM);
        let Pairing::Units(p) = pair_layers(&local, &remote, 16, 16).unwrap() else {
            panic!()
        };
        let k_maps: Vec<_> = p.maps.iter().filter(|m| m.local_region == 0).collect();
        assert_eq!(k_maps[0].remote_region, 0, "head 0 from rank 0");
        assert_eq!(k_maps[1].remote_region, 4, "head 1 from rank 2 (replica 0)");
        // and the other way: each TP 4 rank reads its head from the TP 1 peer
        let local = rank(0..1, &[1], 1, 16, HM);
        let Pairing::Units(p) =
            pair_layers(&local, &rank(0..1, &[0, 1], 0, 16, HM), 16, 16).unwrap()
        else {
            panic!()
        };
        assert_eq!(
            p.maps[0],
            UnitMap {
                local_region: 0,
                local_head: 0,
                remote_region: 0,
                remote_unit: 1
            }
        );
    }

    #[test]
    fn different_head_splits_need_head_major_and_every_head_found() {
        let local = rank(0..2, &[0, 1, 2], 0, 16, TM);
        let remote: Vec<_> = (0..3).flat_map(|r| rank(0..2, &[r], 0, 16, TM)).collect();
        let e = pair_layers(&local, &remote, 16, 16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("head_major"), "{e}");
        let local = rank(0..3, &[0], 0, 16, HM);
        let e = pair_layers(&local, &rank(0..2, &[0], 0, 16, HM), 16, 16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.layers.2.self_attn head 0"), "{e}");
        assert!(pair_layers(&local, &rank(0..3, &[0], 0, 32, HM), 16, 32).is_err());
    }

    #[test]
    fn pipeline_splits_pair_token_major_layers_by_name() {
        let local = rank(0..4, &[0, 1, 2], 0, 32, TM);
        let remote: Vec<_> = [
            rank(0..2, &[0, 1, 2], 0, 16, TM),
            rank(2..4, &[0, 1, 2], 0, 16, TM),
        ]
        .concat();
        let Pairing::Units(p) = pair_layers(&local, &remote, 32, 16).unwrap() else {
            panic!()
        };
        assert_eq!((p.ratio, p.local_heads, p.remote_units), (2, 1, 1));
        assert_eq!(p.maps.len(), 8);
        assert!(p.maps.iter().all(|m| m.local_region == m.remote_region));
    }
}
