//! Per-request block tables on top of the [`BlockPool`], and prefix-cache lookups.
//!
//! Invariants:
//! - A request's table covers its tokens in order: token `t` lives in block `table[t / block_size]`
//!   at offset `t % block_size`.
//! - Allocation is all-or-nothing: a call that cannot get every block it needs changes nothing.
//! - Only blocks whose KV was computed (or loaded and accepted) are registered in the prefix
//!   cache, by [`KvCacheManager::cache_full_blocks`]; a failed load is never registered.
//! - [`KvCacheManager::free`] returns every reference a request holds; after all requests are
//!   freed, every block is free.

use std::collections::HashMap;

use crate::block_hash::BlockHash;
use crate::block_pool::{BlockId, BlockPool};

/// Prefix-cache counters, in tokens (as vLLM's `prefix_cache_queries`/`hits`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    pub queries: u64,
    pub hits: u64,
}

/// Blocks found in the prefix cache for a new request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CachedPrefix {
    pub blocks: Vec<BlockId>,
    pub num_tokens: usize,
}

#[derive(Debug, Default)]
struct RequestBlocks {
    blocks: Vec<BlockId>,
    hashes: Vec<BlockHash>,
    num_cached: usize,
}

/// Block tables of all requests of one engine.
#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    enable_prefix_caching: bool,
    requests: HashMap<u64, RequestBlocks>,
    stats: PrefixCacheStats,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Self {
        assert!(block_size > 0);
        KvCacheManager {
            pool: BlockPool::new(num_blocks),
            block_size,
            enable_prefix_caching,
            requests: HashMap::new(),
            stats: PrefixCacheStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }
    pub fn usage(&self) -> f64 {
        self.pool.usage()
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
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The longest cached prefix of full blocks of `tokens`, leaving at least the last token to
    /// compute (its logits are needed). Counts a query of `tokens.len()` tokens.
    pub fn find_cached_prefix(&mut self, tokens: &[u32], extra_keys: &[u64]) -> CachedPrefix {
        if !self.enable_prefix_caching || tokens.is_empty() {
            return CachedPrefix::default();
        }
        self.stats.queries += tokens.len() as u64;
        let max_blocks = (tokens.len() - 1) / self.block_size;
        let hashes = BlockHash::for_prefix(
            &tokens[..max_blocks * self.block_size],
            self.block_size,
            extra_keys,
        );
        let mut blocks = Vec::new();
        for h in &hashes {
            match self.pool.lookup(h) {
                Some(b) => blocks.push(b),
                None => break,
            }
        }
        let num_tokens = blocks.len() * self.block_size;
        self.stats.hits += num_tokens as u64;
        CachedPrefix { blocks, num_tokens }
    }

    /// Number of blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Makes request `req`'s table cover `num_tokens` tokens. On the request's first call,
    /// `prefix` (from [`Self::find_cached_prefix`]) becomes the head of its table. Returns the
    /// newly allocated blocks, or None (and changes nothing) when not enough blocks are free.
    pub fn allocate(
        &mut self,
        req: u64,
        num_tokens: usize,
        prefix: Option<&CachedPrefix>,
    ) -> Option<Vec<BlockId>> {
        let is_new = !self.requests.contains_key(&req);
        let prefix_blocks: &[BlockId] = match (is_new, prefix) {
            (true, Some(p)) => &p.blocks,
            _ => &[],
        };
        let have = self.requests.get(&req).map_or(0, |r| r.blocks.len()) + prefix_blocks.len();
        let need = self.blocks_for(num_tokens).saturating_sub(have);
        let hits_on_free = prefix_blocks
            .iter()
            .filter(|&&b| self.pool.ref_count(b) == 0)
            .count();
        if need + hits_on_free > self.pool.num_free() {
            return None;
        }
        self.pool.touch(prefix_blocks);
        let new = self.pool.allocate(need).expect("checked above");
        let entry = self.requests.entry(req).or_default();
        entry.blocks.extend_from_slice(prefix_blocks);
        if is_new {
            entry.num_cached = prefix_blocks.len();
        }
        entry.blocks.extend_from_slice(&new);
        Some(new)
    }

    /// The block table of a request (empty if it holds none).
    pub fn block_table(&self, req: u64) -> &[BlockId] {
        self.requests.get(&req).map_or(&[], |r| &r.blocks)
    }

    /// Registers the request's full blocks among its first `num_computed_tokens` tokens in the
    /// prefix cache. `tokens` are the request's tokens (prompt then output).
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
        let full = (num_computed_tokens.min(tokens.len()) / self.block_size).min(r.blocks.len());
        while r.hashes.len() < full {
            let i = r.hashes.len();
            let parent = i.checked_sub(1).map(|p| r.hashes[p]);
            let chunk = &tokens[i * self.block_size..(i + 1) * self.block_size];
            r.hashes.push(BlockHash::chain(parent, chunk, extra_keys));
        }
        for i in r.num_cached..full {
            self.pool.cache(r.blocks[i], r.hashes[i]);
        }
        r.num_cached = r.num_cached.max(full);
    }

    /// Frees every block of a request, last block first (so its tail is evicted first).
    pub fn free(&mut self, req: u64) {
        if let Some(r) = self.requests.remove(&req) {
            self.pool.free(r.blocks.into_iter().rev());
        }
    }

    /// Removes blocks from the prefix-cache index: their content cannot be trusted.
    pub fn uncache_blocks(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.pool.uncache(b);
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
        m.allocate(1, prompt.len(), Some(&p)).unwrap();
        assert_eq!(m.block_table(1).len(), 3);
        m.cache_full_blocks(1, &prompt, 10, &[]);
        // a second request with the same first 9 tokens hits two blocks
        let p2 = m.find_cached_prefix(&prompt[..9], &[]);
        assert_eq!(p2.num_tokens, 8);
        m.allocate(2, 9, Some(&p2)).unwrap();
        assert_eq!(m.block_table(2)[..2], m.block_table(1)[..2]);
        assert_eq!(m.num_free_blocks(), 8 - 4);
        m.free(1);
        m.free(2);
        assert_eq!(m.num_free_blocks(), 8);
        m.pool().check_invariants().unwrap();
        // hits remain after free, until evicted
        let p3 = m.find_cached_prefix(&prompt, &[]);
        assert_eq!(p3.num_tokens, 8);
        assert_eq!(m.prefix_cache_stats().hits, 16);
    }

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut m = KvCacheManager::new(4, 4, true);
        assert!(m.allocate(1, 12, None).is_some());
        assert!(m.allocate(2, 8, None).is_none());
        assert_eq!(m.num_free_blocks(), 1);
        assert!(m.block_table(2).is_empty());
        assert_eq!(m.allocate(1, 13, None).unwrap().len(), 1);
        m.free(1);
        assert_eq!(m.num_free_blocks(), 4);
    }

    #[test]
    fn prompt_never_fully_cached_and_hits_on_free_blocks_count_against_space() {
        let mut m = KvCacheManager::new(3, 2, true);
        let prompt = [1, 2, 3, 4];
        m.allocate(1, 4, None).unwrap();
        m.cache_full_blocks(1, &prompt, 4, &[]);
        m.free(1);
        let p = m.find_cached_prefix(&prompt, &[]);
        assert_eq!(p.num_tokens, 2, "the last token must be computed");
        // one hit block (free) + one new block = 2 <= 3 free
        assert!(m.allocate(2, 4, Some(&p)).is_some());
        assert_eq!(m.num_free_blocks(), 1);
        m.free(2);
        m.pool().check_invariants().unwrap();
    }

    #[test]
    fn uncached_blocks_are_not_hit() {
        let mut m = KvCacheManager::new(4, 2, true);
        m.allocate(1, 4, None).unwrap();
        m.cache_full_blocks(1, &[5, 6, 7, 8], 4, &[]);
        let t = m.block_table(1).to_vec();
        m.uncache_blocks(&t);
        m.free(1);
        assert_eq!(m.find_cached_prefix(&[5, 6, 7, 8, 9], &[]).num_tokens, 0);
    }
}
