//! How many KV blocks each KV cache group gets, and whether the groups share one block table.
//!
//! A model with one group (Llama) has one pool. A hybrid model (Gemma 3: full-attention and
//! sliding-window layers) gets a pool per group, each request a table per group, and its sliding
//! group frees what falls out of the window (`tandem_kv_cache::manager`). Sized from memory, the
//! sliding group gets `--sliding-window-pool-ratio` times the full group's blocks (SGLang's
//! `swa_full_tokens_ratio`), but never more than the running batch can hold at once
//! (`max_num_seqs` windows of `cdiv(window, block_size) + 1` blocks plus one step's tokens); the
//! rest of the memory goes to the full group. `--num-kv-blocks N` gives every group N.
//!
//! Pull-mode P/D moves a table per group too. In push mode (`NixlPushConnector`) the groups still
//! share one table: its registration carries one block list per request (every group's layers at
//! the same block ids).

use std::collections::BTreeMap;

use tandem_kv_cache::{GroupPoolConfig, KvCacheGroup};

/// The sizes of a worker's KV cache pools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPools {
    /// Blocks per layer of each group id (the storage of every rank).
    pub group_blocks: BTreeMap<usize, usize>,
    /// The block manager's pools: one per group id (0, 1, … in order), or one all groups share.
    pub tables: Vec<GroupPoolConfig>,
}

impl KvPools {
    /// Blocks of group `id`'s layers.
    pub fn blocks_of(&self, id: usize) -> usize {
        self.group_blocks[&id]
    }
    /// The largest context one request can hold: the full-attention pool's (a sliding group
    /// needs only its window).
    pub fn max_tokens(&self, block_size: usize) -> usize {
        self.tables
            .iter()
            .filter(|t| t.window.is_none())
            .map(|t| t.num_blocks)
            .min()
            .or_else(|| self.tables.iter().map(|t| t.num_blocks).min())
            .unwrap_or(0)
            * block_size
    }
}

/// What sizes the pools.
#[derive(Debug, Clone, Copy)]
pub struct PoolLimits {
    /// `--num-kv-blocks`: every group this many blocks.
    pub num_blocks: Option<usize>,
    /// `--kv-cache-memory` in bytes.
    pub memory: usize,
    pub block_size: usize,
    /// Groups share one table (push-mode P/D).
    pub shared_tables: bool,
    pub sliding_ratio: f64,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

/// Sizes the pools of a model whose ranks hold `rank_groups`.
pub fn size_pools(rank_groups: &[Vec<KvCacheGroup>], l: PoolLimits) -> Result<KvPools, String> {
    // Bytes one block of each group costs over every rank, and the group's window.
    let mut groups: BTreeMap<usize, (usize, Option<usize>)> = BTreeMap::new();
    for g in rank_groups.iter().flatten() {
        let e = groups.entry(g.group_id).or_insert((0, g.spec.window()));
        e.0 += g.spec.bytes_per_block() * g.layer_names.len();
    }
    if groups.keys().copied().ne(0..groups.len()) {
        return Err(format!(
            "KV cache group ids {:?} are not 0, 1, …",
            groups.keys().collect::<Vec<_>>()
        ));
    }
    let all: usize = groups.values().map(|(b, _)| b).sum();
    let uniform = |n: usize| KvPools {
        group_blocks: groups.keys().map(|&id| (id, n)).collect(),
        tables: vec![GroupPoolConfig {
            num_blocks: n,
            window: None,
        }],
    };
    let check = |n: usize| -> Result<usize, String> {
        if n == 0 {
            Err("the KV cache holds no block: raise --kv-cache-memory or --num-kv-blocks".into())
        } else {
            Ok(n)
        }
    };
    let sliding: Vec<(usize, usize, usize)> = groups
        .iter()
        .filter_map(|(&id, &(b, w))| w.map(|w| (id, b, w)))
        .collect();
    let has_full = groups.values().any(|(_, w)| w.is_none());
    if groups.len() == 1 || l.shared_tables || !has_full {
        let n = check(l.num_blocks.unwrap_or(l.memory / all.max(1)))?;
        return Ok(uniform(n));
    }
    let table = |blocks: &BTreeMap<usize, usize>| {
        groups
            .iter()
            .map(|(id, &(_, window))| GroupPoolConfig {
                num_blocks: blocks[id],
                window,
            })
            .collect()
    };
    if let Some(n) = l.num_blocks {
        let blocks = groups.keys().map(|&id| (id, n)).collect();
        let tables = table(&blocks);
        return Ok(KvPools {
            group_blocks: blocks,
            tables,
        });
    }
    let full_bytes: usize = groups
        .values()
        .filter(|(_, w)| w.is_none())
        .map(|(b, _)| b)
        .sum();
    let bs = l.block_size;
    let bound =
        |w: usize| l.max_num_seqs * (w.div_ceil(bs) + 1) + l.max_num_batched_tokens.div_ceil(bs);
    // Sliding pools at `ratio` of the full pool, each capped at its bound.
    let r = l.sliding_ratio.max(0.0);
    let per_full = full_bytes as f64 + r * sliding.iter().map(|&(_, b, _)| b as f64).sum::<f64>();
    let mut n_full = (l.memory as f64 / per_full) as usize;
    let mut capped = Vec::new();
    for &(id, b, w) in &sliding {
        if (r * n_full as f64) as usize > bound(w) {
            capped.push((id, b, bound(w)));
        }
    }
    if !capped.is_empty() {
        let fixed: usize = capped.iter().map(|&(_, b, n)| b * n).sum();
        let rest: f64 = full_bytes as f64
            + r * sliding
                .iter()
                .filter(|s| !capped.iter().any(|c| c.0 == s.0))
                .map(|&(_, b, _)| b as f64)
                .sum::<f64>();
        n_full = (l.memory.saturating_sub(fixed) as f64 / rest) as usize;
    }
    let n_full = check(n_full)?;
    let blocks: BTreeMap<usize, usize> = groups
        .iter()
        .map(|(&id, &(_, w))| {
            let n = match (w, capped.iter().find(|c| c.0 == id)) {
                (None, _) => n_full,
                (Some(_), Some(&(_, _, n))) => n,
                (Some(_), None) => ((r * n_full as f64) as usize).max(1),
            };
            (id, n)
        })
        .collect();
    let tables = table(&blocks);
    Ok(KvPools {
        group_blocks: blocks,
        tables,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_cache::{CacheDtype, KvCacheSpec};

    /// Gemma 3 270M's shape: 3 full layers, 15 sliding (window 512), 1 KV head of 256, f32.
    fn gemma(bs: usize) -> Vec<KvCacheGroup> {
        let spec = |window: Option<usize>| match window {
            None => KvCacheSpec::FullAttention {
                block_size: bs,
                num_kv_heads: 1,
                head_dim: 256,
                dtype: CacheDtype::F32,
            },
            Some(window) => KvCacheSpec::SlidingWindow {
                block_size: bs,
                num_kv_heads: 1,
                head_dim: 256,
                dtype: CacheDtype::F32,
                window,
            },
        };
        let names = |n: usize| {
            (0..n)
                .map(|i| format!("model.layers.{i}.self_attn"))
                .collect()
        };
        vec![
            KvCacheGroup {
                group_id: 0,
                spec: spec(None),
                layer_names: names(3),
            },
            KvCacheGroup {
                group_id: 1,
                spec: spec(Some(512)),
                layer_names: names(15),
            },
        ]
    }

    fn limits(memory: usize) -> PoolLimits {
        PoolLimits {
            num_blocks: None,
            memory,
            block_size: 16,
            shared_tables: false,
            sliding_ratio: 0.8,
            max_num_seqs: 4,
            max_num_batched_tokens: 512,
        }
    }

    #[test]
    fn a_sliding_pool_is_capped_by_what_the_batch_can_hold_and_the_rest_goes_to_full() {
        let block = 16 * 2 * 256 * 4; // bytes of one block of one layer
        let p = size_pools(&[gemma(16)], limits(1 << 30)).unwrap();
        // 4 windows of 33 blocks and one step of 32 blocks
        assert_eq!(p.blocks_of(1), 4 * 33 + 32);
        let used = p.blocks_of(0) * 3 * block + p.blocks_of(1) * 15 * block;
        assert!(used <= 1 << 30 && (1 << 30) - used < 3 * block);
        // against one shared table: 18 layers per block
        let shared = (1usize << 30) / (18 * block);
        assert!(
            p.blocks_of(0) > 5 * shared,
            "{} vs {shared}",
            p.blocks_of(0)
        );
        assert_eq!(p.max_tokens(16), p.blocks_of(0) * 16);
        assert_eq!(p.tables[1].window, Some(512));
    }

    #[test]
    fn below_the_cap_the_sliding_pool_follows_the_ratio() {
        let block = 16 * 2 * 256 * 4;
        let p = size_pools(&[gemma(16)], limits(100 * 18 * block)).unwrap();
        assert_eq!(p.blocks_of(1), (0.8 * p.blocks_of(0) as f64) as usize);
        assert!(p.blocks_of(1) < 4 * 33 + 32);
    }

    #[test]
    fn shared_tables_and_explicit_counts() {
        let p = size_pools(
            &[gemma(16)],
            PoolLimits {
                shared_tables: true,
                ..limits(1 << 30)
            },
        )
        .unwrap();
        assert_eq!(p.tables.len(), 1);
        assert_eq!(p.blocks_of(0), p.blocks_of(1));
        let p = size_pools(
            &[gemma(16)],
            PoolLimits {
                num_blocks: Some(40),
                ..limits(1 << 30)
            },
        )
        .unwrap();
        assert_eq!(
            (p.blocks_of(0), p.blocks_of(1), p.tables.len()),
            (40, 40, 2)
        );
        assert!(size_pools(&[gemma(16)], limits(1000)).is_err());
    }
}
