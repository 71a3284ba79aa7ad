//! Ref-counted KV blocks, an O(1) LRU free list, and the prefix-cache index.
//!
//! Invariants:
//! - A block is in the free list iff its ref count is 0. Allocation pops the head, freeing pushes
//!   to the tail, and a cache hit on a free block unlinks it from the middle: all O(1) through an
//!   intrusive doubly-linked list.
//! - A block with a hash is findable through `cached` until it is evicted, i.e. reallocated while
//!   free; eviction takes the least recently freed block first.
//! - `num_free() + Σ (blocks with ref count > 0) == num_blocks`.

use std::collections::HashMap;

use crate::block_hash::BlockHash;

/// Index of a block in every layer's cache.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct BlockMeta {
    ref_cnt: u32,
    hash: Option<BlockHash>,
    prev: u32,
    next: u32,
}

/// The pool of KV blocks of one worker group.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<BlockMeta>,
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<BlockHash, BlockId>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks, allocated in id order.
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks < NIL as usize, "too many blocks");
        let n = num_blocks as u32;
        let blocks = (0..n)
            .map(|i| BlockMeta {
                ref_cnt: 0,
                hash: None,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == n { NIL } else { i + 1 },
            })
            .collect();
        BlockPool {
            blocks,
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            num_free: num_blocks,
            cached: HashMap::new(),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }
    /// Blocks with ref count 0 (some may still hold cached content).
    pub fn num_free(&self) -> usize {
        self.num_free
    }
    /// Fraction of blocks in use, 0.0..=1.0.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.num_free as f64 / self.blocks.len() as f64
    }
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks[block as usize].ref_cnt
    }

    fn unlink(&mut self, b: u32) {
        let (prev, next) = {
            let m = &self.blocks[b as usize];
            (m.prev, m.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let m = &mut self.blocks[b as usize];
        m.prev = NIL;
        m.next = NIL;
        self.num_free -= 1;
    }

    fn push_tail(&mut self, b: u32) {
        let m = &mut self.blocks[b as usize];
        m.prev = self.tail;
        m.next = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.blocks[self.tail as usize].next = b;
        }
        self.tail = b;
        self.num_free += 1;
    }

    /// Takes `n` free blocks (evicting their cached content), or None if fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            let m = &mut self.blocks[b as usize];
            m.ref_cnt = 1;
            if let Some(h) = m.hash.take() {
                if self.cached.get(&h) == Some(&b) {
                    self.cached.remove(&h);
                }
            }
            out.push(b);
        }
        Some(out)
    }

    /// Adds a reference to each block (a prefix-cache hit), taking free ones off the free list.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            if self.blocks[b as usize].ref_cnt == 0 {
                self.unlink(b);
            }
            self.blocks[b as usize].ref_cnt += 1;
        }
    }

    /// Drops one reference of each block, in the given order; blocks reaching 0 join the free
    /// list's tail in that order, so they are evicted in that order.
    pub fn free(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            let m = &mut self.blocks[b as usize];
            assert!(m.ref_cnt > 0, "double free of block {b}");
            m.ref_cnt -= 1;
            if m.ref_cnt == 0 {
                self.push_tail(b);
            }
        }
    }

    /// Records that `block` holds the content named `hash`. A block already cached under
    /// another hash, or a hash already held by another block, leaves the index unchanged.
    pub fn cache(&mut self, block: BlockId, hash: BlockHash) {
        let m = &mut self.blocks[block as usize];
        if m.hash.is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(block);
            m.hash = Some(hash);
        }
    }

    /// Removes a block's content from the prefix-cache index (its KV is not trustworthy).
    pub fn uncache(&mut self, block: BlockId) {
        if let Some(h) = self.blocks[block as usize].hash.take() {
            if self.cached.get(&h) == Some(&block) {
                self.cached.remove(&h);
            }
        }
    }

    /// The block holding `hash`, if cached.
    pub fn lookup(&self, hash: &BlockHash) -> Option<BlockId> {
        self.cached.get(hash).copied()
    }

    /// Number of blocks in the prefix-cache index.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Checks every invariant; for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut count = 0usize;
        let mut prev = NIL;
        let mut cur = self.head;
        while cur != NIL {
            let m = &self.blocks[cur as usize];
            if m.ref_cnt != 0 {
                return Err(format!(
                    "block {cur} in free list with ref count {}",
                    m.ref_cnt
                ));
            }
            if m.prev != prev {
                return Err(format!("block {cur} has a broken prev link"));
            }
            count += 1;
            if count > self.blocks.len() {
                return Err("free list has a cycle".into());
            }
            prev = cur;
            cur = m.next;
        }
        if prev != self.tail {
            return Err("tail does not end the free list".into());
        }
        if count != self.num_free {
            return Err(format!(
                "free list has {count} blocks, num_free says {}",
                self.num_free
            ));
        }
        let zero = self.blocks.iter().filter(|m| m.ref_cnt == 0).count();
        if zero != count {
            return Err(format!(
                "{zero} blocks have ref count 0, {count} are in the free list"
            ));
        }
        for (h, &b) in &self.cached {
            if self.blocks[b as usize].hash != Some(*h) {
                return Err(format!(
                    "index maps a hash to block {b}, which holds another"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lru_evicts_least_recently_freed_first() {
        let mut p = BlockPool::new(4);
        let a = p.allocate(4).unwrap();
        for (i, &b) in a.iter().enumerate() {
            p.cache(b, BlockHash(i as u128));
        }
        p.free([a[2], a[0], a[3], a[1]]);
        let got = p.allocate(2).unwrap();
        assert_eq!(got, vec![a[2], a[0]]);
        assert_eq!(
            p.lookup(&BlockHash(2)),
            None,
            "evicted block left the index"
        );
        assert_eq!(p.lookup(&BlockHash(3)), Some(a[3]));
        // a hit on a free cached block takes it off the free list
        p.touch(&[a[3]]);
        assert_eq!(p.num_free(), 1);
        assert_eq!(p.allocate(1).unwrap(), vec![a[1]]);
        assert!(p.allocate(1).is_none());
        p.check_invariants().unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        Free(usize),
        Touch(usize),
        Cache(usize, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..5).prop_map(Op::Alloc),
            any::<usize>().prop_map(Op::Free),
            any::<usize>().prop_map(Op::Touch),
            (any::<usize>(), any::<u8>()).prop_map(|(a, b)| Op::Cache(a, b)),
        ]
    }

    proptest! {
        #[test]
        fn invariants_hold_under_any_sequence(ops in proptest::collection::vec(op(), 0..200)) {
            let mut p = BlockPool::new(16);
            // references we hold, one entry per reference
            let mut held: Vec<BlockId> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        let before = p.num_free();
                        match p.allocate(n) {
                            Some(bs) => { prop_assert_eq!(bs.len(), n); held.extend(bs); }
                            None => prop_assert!(n > before),
                        }
                    }
                    Op::Free(i) if !held.is_empty() => {
                        let b = held.swap_remove(i % held.len());
                        p.free([b]);
                    }
                    Op::Touch(i) if !held.is_empty() => {
                        let b = held[i % held.len()];
                        p.touch(&[b]);
                        held.push(b);
                    }
                    Op::Cache(i, h) if !held.is_empty() => {
                        p.cache(held[i % held.len()], BlockHash(h as u128));
                    }
                    _ => {}
                }
                p.check_invariants().map_err(TestCaseError::fail)?;
                let distinct: std::collections::HashSet<_> = held.iter().collect();
                prop_assert_eq!(p.num_free() + distinct.len(), 16);
            }
            p.free(held.drain(..));
            prop_assert_eq!(p.num_free(), 16);
        }
    }
}
