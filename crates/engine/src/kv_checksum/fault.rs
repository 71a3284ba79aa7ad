//! Injected faults: what `kv_fault_injection` does to a finished load's blocks before they are
//! checksummed, as a transfer could have done without reporting it.
//!
//! Every choice (block, layer, K or V, token, head, byte) comes from an RNG seeded by the
//! load's [`BlockFault::seed`], so a run with the same seed injects the same faults. A
//! corrupted byte always lies in a token slot the checksums cover, so a checksum that works
//! always catches it. Invariant: only the blocks of the load's job are written, and only while
//! the worker owns them (after the connector reported the load finished, before the verdict).

use tandem_kv_cache::{KvPart, KvStorage};
use tandem_kv_checksum::{ChecksumRequest, ScheduledGroup};
pub(crate) use tandem_kv_connector::pull::fault::SplitMix;

use super::config::{BlockFault, FaultKind};

/// The storage layers of a group on this worker.
fn group_layers(storage: &KvStorage, group_id: usize) -> Vec<usize> {
    (0..storage.num_layers())
        .filter(|&i| storage.layer_group(i) == group_id)
        .collect()
}

/// Applies `fault` to the loaded blocks `blocks` selects. Returns what it did, for the log, or
/// `None` when this worker holds none of the blocks' layers (another PP stage's group) or the
/// fault is not a block fault.
///
/// # Safety
/// The caller must own every block of `blocks`: no forward, checksum or transfer may touch them
/// during the call.
pub unsafe fn inject(
    storage: &KvStorage,
    blocks: &ChecksumRequest,
    fault: BlockFault,
) -> Option<String> {
    let mut rng = SplitMix::new(fault.seed);
    let groups: Vec<(&ScheduledGroup, Vec<usize>)> = blocks
        .groups
        .iter()
        .filter(|g| fault.group.is_none_or(|only| only == g.group_id))
        .map(|g| (g, group_layers(storage, g.group_id)))
        .filter(|(g, layers)| !g.block_ids.is_empty() && !layers.is_empty())
        .collect();
    if groups.is_empty() {
        return None;
    }
    match fault.kind {
        FaultKind::CorruptByte => corrupt_byte(
            storage,
            &groups,
            blocks.num_tokens,
            fault.block_position,
            &mut rng,
        ),
        FaultKind::SwapBlocks => {
            let two: Vec<_> = groups
                .iter()
                .filter(|(g, _)| g.block_ids.len() >= 2)
                .collect();
            if two.is_empty() {
                return corrupt_byte(storage, &groups, blocks.num_tokens, None, &mut rng)
                    .map(|d| format!("{d} (one block: nothing to swap)"));
            }
            let (g, layers) = two[rng.below(two.len())];
            let n = g.block_ids.len();
            let a = rng.below(n);
            let b = (a + 1 + rng.below(n - 1)) % n;
            let (ba, bb) = (g.block_ids[a], g.block_ids[b]);
            for &l in layers {
                for part in [KvPart::K, KvPart::V] {
                    // SAFETY: the caller owns both blocks; one copy at a time.
                    unsafe {
                        let x = storage.read_block(l, part, ba).ok()?;
                        let y = storage.read_block(l, part, bb).ok()?;
                        storage.write_block(l, part, ba, &y).ok()?;
                        storage.write_block(l, part, bb, &x).ok()?;
                    }
                }
            }
            Some(format!(
                "swapped blocks {ba} and {bb} (positions {} and {}) of group {}",
                g.start + a,
                g.start + b,
                g.group_id
            ))
        }
        FaultKind::StaleBlocks => {
            let mut count = 0;
            let mut values = Vec::new();
            for (g, layers) in &groups {
                for &block in &g.block_ids {
                    for &l in layers {
                        let dtype = storage.layout(l).dtype;
                        for part in [KvPart::K, KvPart::V] {
                            // Plausible KV of some other request: small values in the cache dtype.
                            let overwrite = |dst: &mut [u8]| {
                                values.clear();
                                values.extend(
                                    (0..dst.len() / dtype.size())
                                        .map(|_| (rng.unit() * 4.0 - 2.0) as f32),
                                );
                                dtype.encode(&values, dst);
                            };
                            // SAFETY: the caller owns the block; one at a time.
                            unsafe { storage.modify_block(l, part, block, overwrite).ok()? };
                        }
                    }
                    count += 1;
                }
            }
            Some(format!(
                "overwrote {count} loaded blocks with other KV (stale blocks)"
            ))
        }
        FaultKind::DropChecksums | FaultKind::MalformChecksums => None,
    }
}

/// Flips one bit of a covered slot: in block position `at` of a group that loaded it, or in a
/// random loaded block.
fn corrupt_byte(
    storage: &KvStorage,
    groups: &[(&ScheduledGroup, Vec<usize>)],
    num_tokens: usize,
    at: Option<usize>,
    rng: &mut SplitMix,
) -> Option<String> {
    let (g, layers, j) = match at {
        None => {
            let (g, layers) = &groups[rng.below(groups.len())];
            (g, layers, rng.below(g.block_ids.len()))
        }
        Some(pos) => {
            let (g, layers) = groups
                .iter()
                .find(|(g, _)| (g.start..g.start + g.block_ids.len()).contains(&pos))?;
            (g, layers, pos - g.start)
        }
    };
    let block = g.block_ids[j];
    let pos = g.start + j;
    let bs = g.block_size;
    // A slot the checksums cover: tokens [first_token, num_tokens) of this block.
    let lo = (pos * bs).max(g.first_token);
    let hi = ((pos + 1) * bs).min(num_tokens);
    if lo >= hi {
        return None;
    }
    let slot = lo - pos * bs + rng.below(hi - lo);
    let layer = layers[rng.below(layers.len())];
    let layout = storage.layout(layer);
    let head = rng.below(layout.num_kv_heads);
    let byte = rng.below(layout.row_bytes());
    let part = if rng.below(2) == 0 {
        KvPart::K
    } else {
        KvPart::V
    };
    let bit = rng.below(8);
    let offset = layout.row_offset(block, slot, head) - block * layout.block_bytes() + byte;
    // SAFETY: the caller owns the block (see `inject`).
    unsafe { storage.modify_block(layer, part, block, |b| b[offset] ^= 1 << bit) }.ok()?;
    Some(format!(
        "flipped bit {bit} of {part:?} byte {byte} of head {head}, token {} in layer {} ({}), \
         block {block} (position {pos}) of group {}",
        pos * bs + slot,
        layer,
        storage.layer_name(layer),
        g.group_id
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_cache::{CacheDtype, KvCacheConfig, KvCacheGroup, KvCacheSpec};
    use tandem_kv_checksum::GroupBlocks;

    fn storage() -> (KvStorage, KvCacheSpec) {
        let spec = KvCacheSpec::FullAttention {
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: CacheDtype::Bf16,
        };
        let cfg = KvCacheConfig {
            num_blocks: 8,
            groups: vec![KvCacheGroup {
                group_id: 0,
                spec,
                layer_names: vec!["layers.0".into(), "layers.1".into()],
            }],
        };
        (KvStorage::new(&cfg).unwrap(), spec)
    }

    fn snapshot(s: &KvStorage) -> Vec<Vec<u8>> {
        (0..s.num_layers())
            .flat_map(|l| {
                let (k, v) = s.layer(l).unwrap().to_vecs();
                [k, v]
            })
            .collect()
    }

    /// A load of tokens [4, 10) of the table [6, 2, 5]: positions 1 and 2, blocks 2 and 5.
    fn load_of_tokens_4_to_10(spec: &KvCacheSpec) -> ChecksumRequest {
        let table: Vec<Option<usize>> = vec![Some(6), Some(2), Some(5)];
        ChecksumRequest::for_load(
            4,
            10,
            &[GroupBlocks {
                group_id: 0,
                spec,
                first_position: 0,
                blocks: &table,
            }],
        )
    }

    #[test]
    fn each_block_fault_changes_only_the_loaded_blocks() {
        for kind in [
            FaultKind::CorruptByte,
            FaultKind::SwapBlocks,
            FaultKind::StaleBlocks,
        ] {
            let (s, spec) = storage();
            // distinct content per block
            for slot in 0..32 {
                let k: Vec<f32> = (0..16).map(|i| (slot * 16 + i) as f32).collect();
                for l in 0..2 {
                    s.write_slots(l, &[slot], &k, &k).unwrap();
                }
            }
            let before = snapshot(&s);
            let req = load_of_tokens_4_to_10(&spec);
            let what = unsafe {
                inject(
                    &s,
                    &req,
                    BlockFault {
                        kind,
                        seed: 3,
                        block_position: None,
                        tp_rank: None,
                        group: None,
                    },
                )
            };
            assert!(what.is_some(), "{kind:?}");
            let after = snapshot(&s);
            let bb = s.layout(0).block_bytes();
            let mut changed_blocks = std::collections::BTreeSet::new();
            for (a, b) in before.iter().zip(&after) {
                for blk in 0..8 {
                    if a[blk * bb..(blk + 1) * bb] != b[blk * bb..(blk + 1) * bb] {
                        changed_blocks.insert(blk);
                    }
                }
            }
            assert!(!changed_blocks.is_empty(), "{kind:?} changed nothing");
            assert!(
                changed_blocks.iter().all(|b| [2, 5].contains(b)),
                "{kind:?} touched {changed_blocks:?}"
            );
        }
    }

    #[test]
    fn a_corrupt_byte_at_a_block_position_changes_that_block_only() {
        let (s, spec) = storage();
        let req = load_of_tokens_4_to_10(&spec);
        for (position, block) in [(1usize, 2usize), (2, 5)] {
            for seed in 0..8 {
                let before = snapshot(&s);
                let fault = BlockFault {
                    kind: FaultKind::CorruptByte,
                    seed,
                    block_position: Some(position),
                    tp_rank: None,
                    group: None,
                };
                let what = unsafe { inject(&s, &req, fault) }.expect("a loaded position");
                assert!(what.contains(&format!("(position {position})")), "{what}");
                let bb = s.layout(0).block_bytes();
                let changed: std::collections::BTreeSet<usize> = before
                    .iter()
                    .zip(&snapshot(&s))
                    .flat_map(|(a, b)| {
                        (0..8).filter(move |&blk| {
                            a[blk * bb..(blk + 1) * bb] != b[blk * bb..(blk + 1) * bb]
                        })
                    })
                    .collect();
                assert_eq!(changed, [block].into(), "position {position}, seed {seed}");
            }
        }
        // position 0 is the consumer's own block, not loaded: nothing is written
        let before = snapshot(&s);
        let fault = BlockFault {
            kind: FaultKind::CorruptByte,
            seed: 1,
            block_position: Some(0),
            tp_rank: None,
            group: None,
        };
        assert_eq!(unsafe { inject(&s, &req, fault) }, None);
        assert_eq!(before, snapshot(&s));
    }

    #[test]
    fn the_rng_is_deterministic_and_bounded() {
        let mut a = SplitMix::new(5);
        let mut b = SplitMix::new(5);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
            let u = a.unit();
            b.unit();
            assert!((0.0..1.0).contains(&u));
            assert!(a.below(3) < 3);
            b.below(3);
        }
    }
}
