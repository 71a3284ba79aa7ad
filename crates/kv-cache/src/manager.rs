//! Per-request block tables on top of the [`BlockPool`]s, one table per KV cache group, and
//! prefix-cache lookups.
//!
//! A hybrid model's groups each have their own pool of blocks (their layers are distinct
//! memory) and each request one table per group. A full-attention group keeps every block of a
//! request; a sliding-window group of window `w` needs, for the first token it computes next,
//! only the blocks holding the positions `[computed + 1 - w, computed]`: the blocks wholly before
//! them are freed and become [`NULL_BLOCK`] in its table. Between steps a request therefore
//! holds at most `cdiv(w, block_size) + 1` blocks of a sliding group.
//!
//! Invariants:
//! - A request's table in each group covers its tokens in order: token `t` lives in block
//!   `table[t / block_size]` at offset `t % block_size`; in a sliding group, entries before the
//!   window are [`NULL_BLOCK`] (never read or written) and every entry after the first non-null
//!   one is non-null.
//! - Allocation is all-or-nothing over all groups: a call that cannot get every block it needs
//!   in every group changes nothing. Blocks that fell out of a window are freed only by an
//!   explicit [`KvCacheManager::remove_out_of_window`].
//! - Only blocks whose KV was computed (or loaded and accepted) are registered in the prefix
//!   cache, by [`KvCacheManager::cache_full_blocks`]; a failed load is never registered.
//! - A prefix hit of `n` tokens holds what every group needs to compute token `n`: the
//!   full-attention groups' blocks of `[0, n)`, the sliding groups' blocks of the window before
//!   `n`.
//! - [`KvCacheManager::free`] returns every reference a request holds; after all requests are
//!   freed, every block of every group is free.

use std::collections::HashMap;

use crate::block_hash::BlockHash;
use crate::block_pool::{BlockId, BlockPool};

/// The table entry of a block a sliding-window group does not hold (before its window).
pub const NULL_BLOCK: BlockId = BlockId::MAX;

/// Group `group`'s entry of a request's per-group list (block tables, slot mappings, transfer
/// pairs): one entry per KV cache group by group id, or a single entry every group shares.
pub fn group_table<T>(per_group: &[T], group: usize) -> Option<&T> {
    match per_group {
        [shared] => Some(shared),
        per_group => per_group.get(group),
    }
}

/// Prefix-cache counters, in tokens (as vLLM's `prefix_cache_queries`/`hits`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    pub queries: u64,
    pub hits: u64,
}

/// One KV cache group's pool: how many blocks, and the window its layers attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPoolConfig {
    pub num_blocks: usize,
    /// `None`: full attention (every block kept).
    pub window: Option<usize>,
}

/// Blocks found in the prefix cache for a new request, per group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CachedPrefix {
    /// Per group: the table's head, `num_tokens / block_size` entries ([`NULL_BLOCK`] before a
    /// sliding group's window). Empty when nothing was found.
    pub blocks: Vec<Vec<BlockId>>,
    pub num_tokens: usize,
}

#[derive(Debug, Default, Clone)]
struct GroupTable {
    blocks: Vec<BlockId>,
    /// Entries `[0, num_cached)` were offered to the prefix cache (null ones skipped).
    num_cached: usize,
}

#[derive(Debug)]
struct RequestBlocks {
    groups: Vec<GroupTable>,
    /// The hash of each full block of the request's tokens so far (shared by all groups).
    hashes: Vec<BlockHash>,
}

#[derive(Debug)]
struct GroupPool {
    pool: BlockPool,
    window: Option<usize>,
}

/// Block tables of all requests of one engine.
#[derive(Debug)]
pub struct KvCacheManager {
    groups: Vec<GroupPool>,
    block_size: usize,
    enable_prefix_caching: bool,
    requests: HashMap<u64, RequestBlocks>,
    stats: PrefixCacheStats,
}

/// The first block a sliding group of `window` needs to compute the token at position
/// `computed` (which attends to `[computed + 1 - window, computed]`).
fn first_needed_block(window: usize, computed: usize, block_size: usize) -> usize {
    (computed + 1).saturating_sub(window) / block_size
}

impl KvCacheManager {
    /// A manager of one full-attention group of `num_blocks` blocks.
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Self {
        Self::with_groups(
            &[GroupPoolConfig {
                num_blocks,
                window: None,
            }],
            block_size,
            enable_prefix_caching,
        )
    }

    /// A manager of one pool per KV cache group, in group order.
    pub fn with_groups(
        groups: &[GroupPoolConfig],
        block_size: usize,
        enable_prefix_caching: bool,
    ) -> Self {
        assert!(block_size > 0 && !groups.is_empty());
        KvCacheManager {
            groups: groups
                .iter()
                .map(|g| GroupPool {
                    pool: BlockPool::new(g.num_blocks),
                    window: g.window.filter(|&w| w > 0),
                })
                .collect(),
            block_size,
            enable_prefix_caching,
            requests: HashMap::new(),
            stats: PrefixCacheStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }
    /// The sliding window of group `g` (None: full attention).
    pub fn group_window(&self, g: usize) -> Option<usize> {
        self.groups[g].window
    }
    /// Blocks of every group.
    pub fn num_blocks(&self) -> usize {
        self.groups.iter().map(|g| g.pool.num_blocks()).sum()
    }
    /// Free blocks of every group.
    pub fn num_free_blocks(&self) -> usize {
        self.groups.iter().map(|g| g.pool.num_free()).sum()
    }
    /// Group `g`'s pool.
    pub fn group_pool(&self, g: usize) -> &BlockPool {
        &self.groups[g].pool
    }
    /// The fullest group's usage: the pool that runs out first bounds admission.
    pub fn usage(&self) -> f64 {
        self.groups
            .iter()
            .map(|g| g.pool.usage())
            .fold(0.0, f64::max)
    }
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }
    pub fn prefix_caching_enabled(&self) -> bool {
        self.enable_prefix_caching
    }
    /// Number of requests holding blocks.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }
    /// Checks every pool's invariants and that no request holds a block twice; for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (g, group) in self.groups.iter().enumerate() {
            group
                .pool
                .check_invariants()
                .map_err(|e| format!("group {g}: {e}"))?;
            for (id, r) in &self.requests {
                let t = &r.groups[g].blocks;
                let first = t.iter().position(|&b| b != NULL_BLOCK).unwrap_or(t.len());
                if t[first..].contains(&NULL_BLOCK) {
                    return Err(format!(
                        "request {id} group {g}: a null block after a held one"
                    ));
                }
                if group.window.is_none() && first > 0 {
                    return Err(format!(
                        "request {id} group {g}: null block in full attention"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The longest cached prefix of full blocks of `tokens` that every group can resume from,
    /// leaving at least the last token to compute (its logits are needed). Counts a query of
    /// `tokens.len()` tokens.
    pub fn find_cached_prefix(&mut self, tokens: &[u32], extra_keys: &[u64]) -> CachedPrefix {
        if !self.enable_prefix_caching || tokens.is_empty() {
            return CachedPrefix::default();
        }
        self.stats.queries += tokens.len() as u64;
        let bs = self.block_size;
        let max_blocks = (tokens.len() - 1) / bs;
        let hashes = BlockHash::for_prefix(&tokens[..max_blocks * bs], bs, extra_keys);
        // Per group, the cached block of each position (full groups stop at their first miss).
        let hits: Vec<Vec<Option<BlockId>>> = self
            .groups
            .iter()
            .map(|g| {
                let mut found: Vec<_> = hashes.iter().map(|h| g.pool.lookup(h)).collect();
                if g.window.is_none() {
                    let end = found
                        .iter()
                        .position(Option::is_none)
                        .unwrap_or(found.len());
                    found.truncate(end);
                }
                found
            })
            .collect();
        let mut k = self
            .groups
            .iter()
            .zip(&hits)
            .filter(|(g, _)| g.window.is_none())
            .map(|(_, h)| h.len())
            .min()
            .unwrap_or(max_blocks);
        let window_held = |k: usize| {
            self.groups.iter().zip(&hits).all(|(g, h)| match g.window {
                None => true,
                Some(w) => h[first_needed_block(w, k * bs, bs).min(k)..k]
                    .iter()
                    .all(Option::is_some),
            })
        };
        while k > 0 && !window_held(k) {
            k -= 1;
        }
        if k == 0 {
            return CachedPrefix::default();
        }
        let blocks = self
            .groups
            .iter()
            .zip(&hits)
            .map(|(g, h)| {
                let lo = g
                    .window
                    .map_or(0, |w| first_needed_block(w, k * bs, bs).min(k));
                let mut t = vec![NULL_BLOCK; lo];
                t.extend(h[lo..k].iter().map(|b| b.expect("checked held")));
                t
            })
            .collect();
        self.stats.hits += (k * bs) as u64;
        CachedPrefix {
            blocks,
            num_tokens: k * bs,
        }
    }

    /// Number of blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Frees the blocks of request `req`'s sliding-window groups that no token from position
    /// `num_computed` on attends to; they become [`NULL_BLOCK`] in its tables.
    pub fn remove_out_of_window(&mut self, req: u64, num_computed: usize) {
        let Some(r) = self.requests.get_mut(&req) else {
            return;
        };
        for (g, t) in self.groups.iter_mut().zip(&mut r.groups) {
            let Some(w) = g.window else { continue };
            let end = first_needed_block(w, num_computed, self.block_size).min(t.blocks.len());
            // Oldest first: they are evicted from the prefix cache in that order.
            let freed: Vec<BlockId> = t.blocks[..end]
                .iter_mut()
                .filter(|b| **b != NULL_BLOCK)
                .map(|b| std::mem::replace(b, NULL_BLOCK))
                .collect();
            g.pool.free(freed);
        }
    }

    /// Makes request `req`'s tables cover `num_tokens` tokens, of which the first
    /// `num_computed` are (or, for a load, will be) in the cache before this step computes any.
    /// In each sliding group, new entries before the window of `num_computed` stay null and null
    /// entries from there on get blocks (a request resuming before its window, see
    /// [`Self::resume_point`]); blocks already held before the window stay until the caller
    /// frees them with [`Self::remove_out_of_window`] (first, so the allocation can reuse them),
    /// which it may not do while something still reads them. On the request's first
    /// call, `prefix` (from [`Self::find_cached_prefix`]) becomes the head of its tables.
    /// Returns the newly allocated blocks per group, or None (and allocates nothing) when a
    /// group has too few free blocks.
    pub fn allocate(
        &mut self,
        req: u64,
        num_tokens: usize,
        num_computed: usize,
        prefix: Option<&CachedPrefix>,
    ) -> Option<Vec<Vec<BlockId>>> {
        let is_new = !self.requests.contains_key(&req);
        let total = self.blocks_for(num_tokens);
        let bs = self.block_size;
        let num_groups = self.groups.len();
        let entry = self.requests.remove(&req);
        let mut tables: Vec<Vec<BlockId>> = match (&entry, prefix) {
            (Some(r), _) => r.groups.iter().map(|t| t.blocks.clone()).collect(),
            (None, Some(p)) => (0..num_groups)
                .map(|g| p.blocks.get(g).cloned().unwrap_or_default())
                .collect(),
            (None, None) => vec![Vec::new(); num_groups],
        };
        // Per group: the first entry that must hold a block, and how many blocks to take.
        let mut plan = Vec::with_capacity(num_groups);
        let mut fits = true;
        for (group, t) in self.groups.iter().zip(&tables) {
            let lo = group
                .window
                .map_or(0, |w| first_needed_block(w, num_computed, bs));
            let refill = t.iter().skip(lo).filter(|&&b| b == NULL_BLOCK).count();
            let grow = total.saturating_sub(t.len().max(lo));
            let hits_on_free = if is_new {
                t.iter()
                    .filter(|&&b| b != NULL_BLOCK && group.pool.ref_count(b) == 0)
                    .count()
            } else {
                0
            };
            fits &= refill + grow + hits_on_free <= group.pool.num_free();
            plan.push((lo, refill + grow));
        }
        if !fits {
            if let Some(r) = entry {
                self.requests.insert(req, r);
            }
            return None;
        }
        let mut r = entry.unwrap_or_else(|| RequestBlocks {
            groups: vec![GroupTable::default(); num_groups],
            hashes: Vec::new(),
        });
        let mut allocated = Vec::with_capacity(num_groups);
        for (g, (group, (lo, need))) in self.groups.iter_mut().zip(plan).enumerate() {
            let t = &mut tables[g];
            if is_new {
                let live: Vec<BlockId> = t.iter().copied().filter(|&b| b != NULL_BLOCK).collect();
                group.pool.touch(&live);
                r.groups[g].num_cached = t.len();
            }
            // The pool gives the least recently freed blocks; in id order they hold the request's
            // positions (a request's freed run comes back reversed): consecutive ids move as one
            // NIXL descriptor (one region per run of blocks).
            let mut new = group.pool.allocate(need).expect("checked above");
            new.sort_unstable();
            let mut fresh = new.iter().copied();
            if t.len() < total {
                t.resize(total, NULL_BLOCK);
            }
            for b in t.iter_mut().skip(lo) {
                if *b == NULL_BLOCK {
                    *b = fresh.next().expect("counted above");
                }
            }
            r.groups[g].blocks = std::mem::take(t);
            allocated.push(new);
        }
        self.requests.insert(req, r);
        Some(allocated)
    }

    /// Where a request whose cache is good for positions `[0, p)` can resume computing: `p`
    /// when every sliding group holds the blocks of the window before `p`, else 0 (what a
    /// sliding group dropped, or never loaded, must be computed again).
    pub fn resume_point(&self, req: u64, p: usize) -> usize {
        let Some(r) = self.requests.get(&req) else {
            return 0;
        };
        let bs = self.block_size;
        let held = self
            .groups
            .iter()
            .zip(&r.groups)
            .all(|(g, t)| match g.window {
                None => true,
                Some(w) => t
                    .blocks
                    .iter()
                    .take(p.div_ceil(bs))
                    .skip(first_needed_block(w, p, bs))
                    .all(|&b| b != NULL_BLOCK),
            });
        if held {
            p
        } else {
            0
        }
    }

    /// Group `g`'s block table of a request (empty if it holds none).
    pub fn group_table(&self, req: u64, g: usize) -> &[BlockId] {
        self.requests.get(&req).map_or(&[], |r| &r.groups[g].blocks)
    }

    /// Every group's block table of a request, in group order (empty tables if it holds none).
    pub fn block_tables(&self, req: u64) -> Vec<Vec<BlockId>> {
        (0..self.groups.len())
            .map(|g| self.group_table(req, g).to_vec())
            .collect()
    }

    /// Whether the request holds no block.
    pub fn holds_nothing(&self, req: u64) -> bool {
        !self.requests.contains_key(&req)
    }

    /// Registers the request's full blocks among its first `num_computed_tokens` tokens in the
    /// prefix cache, in every group (null entries skipped). `tokens` are the request's tokens
    /// (prompt then output).
    pub fn cache_full_blocks(
        &mut self,
        req: u64,
        tokens: &[u32],
        num_computed_tokens: usize,
        extra_keys: &[u64],
    ) {
        if !self.enable_prefix_caching {
            return;
        }
        let Some(r) = self.requests.get_mut(&req) else {
            return;
        };
        let bs = self.block_size;
        let table_len = r.groups.iter().map(|t| t.blocks.len()).max().unwrap_or(0);
        let full = (num_computed_tokens.min(tokens.len()) / bs).min(table_len);
        while r.hashes.len() < full {
            let i = r.hashes.len();
            let parent = i.checked_sub(1).map(|p| r.hashes[p]);
            r.hashes.push(BlockHash::chain(
                parent,
                &tokens[i * bs..(i + 1) * bs],
                extra_keys,
            ));
        }
        for (group, t) in self.groups.iter_mut().zip(&mut r.groups) {
            let end = full.min(t.blocks.len());
            for i in t.num_cached..end {
                if t.blocks[i] != NULL_BLOCK {
                    group.pool.cache(t.blocks[i], r.hashes[i]);
                }
            }
            t.num_cached = t.num_cached.max(end);
        }
    }

    /// Frees every block of a request, last block first in each group (so its tail is evicted
    /// first).
    pub fn free(&mut self, req: u64) {
        if let Some(r) = self.requests.remove(&req) {
            for (group, t) in self.groups.iter_mut().zip(r.groups) {
                group
                    .pool
                    .free(t.blocks.into_iter().rev().filter(|&b| b != NULL_BLOCK));
            }
        }
    }

    /// Removes blocks of every group's table in `tables` from the prefix-cache index: their
    /// content cannot be trusted.
    pub fn uncache_blocks(&mut self, tables: &[Vec<BlockId>]) {
        for (group, t) in self.groups.iter_mut().zip(tables) {
            for &b in t.iter().filter(|&&b| b != NULL_BLOCK) {
                group.pool.uncache(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_hit_shares_blocks_and_everything_is_freed() {
        let mut m = KvCacheManager::new(8, 4, true);
        let prompt: Vec<u32> = (0..10).collect();
        let p = m.find_cached_prefix(&prompt, &[]);
        assert_eq!(p.num_tokens, 0);
        m.allocate(1, prompt.len(), 0, Some(&p)).unwrap();
        assert_eq!(m.group_table(1, 0).len(), 3);
        m.cache_full_blocks(1, &prompt, 10, &[]);
        // a second request with the same first 9 tokens hits two blocks
        let p2 = m.find_cached_prefix(&prompt[..9], &[]);
        assert_eq!(p2.num_tokens, 8);
        m.allocate(2, 9, 8, Some(&p2)).unwrap();
        assert_eq!(m.group_table(2, 0)[..2], m.group_table(1, 0)[..2]);
        assert_eq!(m.num_free_blocks(), 8 - 4);
        m.free(1);
        m.free(2);
        assert_eq!(m.num_free_blocks(), 8);
        m.check_invariants().unwrap();
        // hits remain after free, until evicted
        let p3 = m.find_cached_prefix(&prompt, &[]);
        assert_eq!(p3.num_tokens, 8);
        assert_eq!(m.prefix_cache_stats().hits, 16);
    }

    #[test]
    fn a_request_reusing_freed_blocks_gets_them_in_id_order() {
        let mut m = KvCacheManager::new(16, 4, true);
        m.allocate(1, 24, 0, None).unwrap();
        assert_eq!(m.group_table(1, 0), &[0, 1, 2, 3, 4, 5][..]);
        m.free(1); // last block first: the free list holds 5, 4, 3, 2, 1, 0 after 6..16
        m.allocate(2, 40, 0, None).unwrap();
        assert_eq!(
            m.group_table(2, 0),
            &[6, 7, 8, 9, 10, 11, 12, 13, 14, 15][..]
        );
        m.allocate(3, 16, 0, None).unwrap();
        assert_eq!(
            m.group_table(3, 0),
            &[2, 3, 4, 5][..],
            "the least recently freed four, consecutive in the table"
        );
        m.check_invariants().unwrap();
    }

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut m = KvCacheManager::new(4, 4, true);
        assert!(m.allocate(1, 12, 0, None).is_some());
        assert!(m.allocate(2, 8, 0, None).is_none());
        assert_eq!(m.num_free_blocks(), 1);
        assert!(m.group_table(2, 0).is_empty());
        assert!(m.holds_nothing(2));
        assert_eq!(m.allocate(1, 13, 12, None).unwrap()[0].len(), 1);
        m.free(1);
        assert_eq!(m.num_free_blocks(), 4);
    }

    #[test]
    fn prompt_never_fully_cached_and_hits_on_free_blocks_count_against_space() {
        let mut m = KvCacheManager::new(3, 2, true);
        let prompt = [1, 2, 3, 4];
        m.allocate(1, 4, 0, None).unwrap();
        m.cache_full_blocks(1, &prompt, 4, &[]);
        m.free(1);
        let p = m.find_cached_prefix(&prompt, &[]);
        assert_eq!(p.num_tokens, 2, "the last token must be computed");
        // one hit block (free) + one new block = 2 <= 3 free
        assert!(m.allocate(2, 4, 2, Some(&p)).is_some());
        assert_eq!(m.num_free_blocks(), 1);
        m.free(2);
        m.check_invariants().unwrap();
    }

    #[test]
    fn uncached_blocks_are_not_hit() {
        let mut m = KvCacheManager::new(4, 2, true);
        m.allocate(1, 4, 0, None).unwrap();
        m.cache_full_blocks(1, &[5, 6, 7, 8], 4, &[]);
        let t = m.block_tables(1);
        m.uncache_blocks(&t);
        m.free(1);
        assert_eq!(m.find_cached_prefix(&[5, 6, 7, 8, 9], &[]).num_tokens, 0);
    }

    /// Group 0 full attention, group 1 a sliding window of `window` tokens.
    fn hybrid(full: usize, sliding: usize, window: usize, bs: usize) -> KvCacheManager {
        KvCacheManager::with_groups(
            &[
                GroupPoolConfig {
                    num_blocks: full,
                    window: None,
                },
                GroupPoolConfig {
                    num_blocks: sliding,
                    window: Some(window),
                },
            ],
            bs,
            true,
        )
    }

    fn held(m: &KvCacheManager, req: u64, g: usize) -> usize {
        m.group_table(req, g)
            .iter()
            .filter(|&&b| b != NULL_BLOCK)
            .count()
    }

    #[test]
    fn sliding_group_frees_blocks_out_of_its_window() {
        // window 8, blocks of 4: at most cdiv(8, 4) + 1 = 3 sliding blocks between steps
        let mut m = hybrid(64, 64, 8, 4);
        m.allocate(1, 20, 0, None).unwrap(); // a 20-token prefill chunk needs every block
        assert_eq!((held(&m, 1, 0), held(&m, 1, 1)), (5, 5));
        for computed in 20..60 {
            m.remove_out_of_window(1, computed);
            m.allocate(1, computed + 1, computed, None).unwrap();
            assert_eq!(held(&m, 1, 0), (computed + 1).div_ceil(4));
            assert!(held(&m, 1, 1) <= 3, "{} at {computed}", held(&m, 1, 1));
            // the window of the token at `computed` is [computed - 7, computed]: all held
            let t = m.group_table(1, 1);
            for pos in computed - 7..=computed {
                assert_ne!(t[pos / 4], NULL_BLOCK, "position {pos} at {computed}");
            }
            m.check_invariants().unwrap();
        }
        assert_eq!(m.group_pool(1).num_free(), 64 - held(&m, 1, 1));
        m.free(1);
        assert_eq!(m.num_free_blocks(), 128);
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_load_into_a_sliding_group_takes_only_the_window() {
        let mut m = hybrid(64, 64, 8, 4);
        // 40 tokens loaded, the step computes from 40: positions 33..=40 needed
        let new = m.allocate(1, 41, 40, None).unwrap();
        assert_eq!(new[0].len(), 11);
        assert_eq!(new[1].len(), 3, "blocks 8, 9, 10");
        let t = m.group_table(1, 1);
        assert!(t[..8].iter().all(|&b| b == NULL_BLOCK));
        m.free(1);
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_sliding_group_without_blocks_fails_the_whole_allocation() {
        let mut m = hybrid(64, 2, 8, 4);
        assert!(m.allocate(1, 20, 0, None).is_none());
        assert!(m.holds_nothing(1));
        assert_eq!(m.num_free_blocks(), 66);
        // a decoding request holding 2 sliding blocks cannot grow into a third
        m.allocate(2, 8, 0, None).unwrap();
        assert!(m.allocate(2, 9, 8, None).is_none());
        assert_eq!(m.group_table(2, 0).len(), 2, "group 0 unchanged");
    }

    #[test]
    fn prefix_hit_needs_what_each_group_needs() {
        let mut m = hybrid(64, 64, 8, 4);
        let prompt: Vec<u32> = (0..30).collect();
        m.allocate(1, 30, 0, None).unwrap();
        m.cache_full_blocks(1, &prompt, 30, &[]);
        // decoding on frees the sliding blocks of the prompt's start
        m.remove_out_of_window(1, 30);
        m.allocate(1, 31, 30, None).unwrap();
        m.free(1);
        // every block is cached in both groups (freed, not evicted): a 28-token hit
        let p = m.find_cached_prefix(&prompt, &[]);
        assert_eq!(p.num_tokens, 28);
        assert_eq!(p.blocks[0].len(), 7);
        // the sliding group holds the window of position 28: blocks 5 and 6
        assert_eq!(p.blocks[1][..5], [NULL_BLOCK; 5]);
        assert!(p.blocks[1][5..].iter().all(|&b| b != NULL_BLOCK));
        m.allocate(2, 30, 28, Some(&p)).unwrap();
        assert_eq!(held(&m, 2, 1), 3);
        m.free(2);
        m.check_invariants().unwrap();

        // evict the sliding group's block 5: a hit at 28 is impossible, one at 20 needs blocks
        // 3 and 4 (cached)
        let mut m = hybrid(64, 64, 8, 4);
        m.allocate(1, 30, 0, None).unwrap();
        m.cache_full_blocks(1, &prompt, 30, &[]);
        let b5 = m.group_table(1, 1)[5];
        m.uncache_blocks(&[vec![], vec![b5]]);
        m.free(1);
        let p = m.find_cached_prefix(&prompt, &[]);
        assert_eq!(p.num_tokens, 20);
        assert_eq!(p.blocks[1].len(), 5);
        assert_eq!(p.blocks[1][..3], [NULL_BLOCK; 3]);
        // and a miss in the full group caps the hit whatever the sliding group holds
        let b1 = m
            .group_pool(0)
            .lookup(&BlockHash::for_prefix(&prompt[..8], 4, &[])[1]);
        m.uncache_blocks(&[vec![b1.unwrap()], vec![]]);
        assert_eq!(m.find_cached_prefix(&prompt, &[]).num_tokens, 4);
    }

    #[test]
    fn resuming_before_the_window_recomputes_from_the_start() {
        let mut m = hybrid(64, 64, 8, 4);
        m.allocate(1, 41, 40, None).unwrap(); // a load: sliding blocks 8..=10 only
        assert_eq!(m.resume_point(1, 40), 40);
        assert_eq!(
            m.resume_point(1, 39),
            39,
            "the window of 39 is blocks 8..=9"
        );
        assert_eq!(
            m.resume_point(1, 36),
            0,
            "the window of 36 is blocks 7..=8: 7 is null"
        );
        assert_eq!(m.resume_point(1, 20), 0);
        // resuming at 0 gives every position a block again
        m.allocate(1, 41, 0, None).unwrap();
        assert_eq!(held(&m, 1, 1), 11);
        m.free(1);
        m.check_invariants().unwrap();
        assert_eq!(m.num_free_blocks(), 128);
    }

    proptest::proptest! {
        /// Random requests prefill in chunks and decode, some through prefix hits, under block
        /// pressure: every computed token's window is held, a sliding group never holds more
        /// than cdiv(window, bs) + 1 blocks between steps, and every block comes back.
        #[test]
        fn hybrid_tables_hold_every_window_and_free_everything(
            ops in proptest::collection::vec((0u64..6, 1usize..40, 0u8..3), 1..120),
            window in 1usize..24,
            bs in 1usize..6,
        ) {
            let mut m = hybrid(40, 12, window, bs);
            let mut computed: HashMap<u64, usize> = HashMap::new();
            let prompt = |id: u64| -> Vec<u32> { (0..200).map(|t| (t % 7 + id % 2) as u32).collect() };
            for (id, n, op) in ops {
                if op == 0 && computed.contains_key(&id) {
                    m.free(id);
                    computed.remove(&id);
                    continue;
                }
                let (start, prefix) = match computed.get(&id) {
                    Some(&c) => (c, None),
                    None => {
                        let p = m.find_cached_prefix(&prompt(id)[..n + 1], &[]);
                        (p.num_tokens, Some(p))
                    }
                };
                let end = (start + n).min(200);
                if end <= start { continue; }
                if m.allocate(id, end, start, prefix.as_ref()).is_none() {
                    proptest::prop_assert!(computed.contains_key(&id) || m.holds_nothing(id));
                    continue;
                }
                let t1 = m.group_table(id, 1);
                let t0 = m.group_table(id, 0);
                proptest::prop_assert_eq!(t0.len(), end.div_ceil(bs));
                proptest::prop_assert_eq!(t1.len(), end.div_ceil(bs));
                for pos in (start + 1).saturating_sub(window)..end {
                    proptest::prop_assert_ne!(t1[pos / bs], NULL_BLOCK);
                }
                m.cache_full_blocks(id, &prompt(id), end, &[]);
                computed.insert(id, end);
                m.remove_out_of_window(id, end);
                proptest::prop_assert!(held(&m, id, 1) <= window.div_ceil(bs) + 1);
                m.check_invariants().map_err(proptest::test_runner::TestCaseError::fail)?;
            }
            for id in computed.keys() {
                m.free(*id);
            }
            proptest::prop_assert_eq!(m.num_free_blocks(), 52);
            m.check_invariants().map_err(proptest::test_runner::TestCaseError::fail)?;
        }
    }
}
