//! Which blocks of a request are checksummed: the scheduler's selection, sent to every worker.
//!
//! Rules, applied per group to the block positions holding tokens `[first_token, num_tokens)`:
//! 1. a sliding-window group keeps its last `cdiv(window, block_size) + 1` positions (the clip
//!    transfers apply);
//! 2. leading null blocks are left out (the first token moves to the first kept block);
//! 3. a null block after a non-null one skips the group;
//! 4. a group left with no block is not checksummed at all (nothing to compare).
//!
//! The producer selects `[0, num_tokens)` of the prompt; the consumer selects the tokens its load
//! writes, `[num_local_computed_tokens, num_computed_tokens)`, so a local prefix hit compares
//! only the loaded blocks. Invariants: a [`ScheduledGroup`] holds at least one block, its
//! `first_token` lies in its first block and before `num_tokens`.

use serde::{Deserialize, Serialize};
use tandem_kv_cache::KvCacheSpec;
use xxhash_rust::xxh3::Xxh3;

use crate::record::SkipReason;

/// A cache block id; `None` is a null block (e.g. out of a sliding window).
pub type BlockId = Option<usize>;

/// A group's block table as the scheduler knows it: `blocks[i]` holds position
/// `first_position + i`.
#[derive(Debug, Clone, Copy)]
pub struct GroupBlocks<'a> {
    pub group_id: usize,
    pub spec: &'a KvCacheSpec,
    pub first_position: usize,
    pub blocks: &'a [BlockId],
}

/// The blocks of one group that every worker checksums.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduledGroup {
    pub group_id: usize,
    pub block_size: usize,
    /// Position of `block_ids[0]`.
    pub start: usize,
    /// First token covered; in `[start * block_size, (start + 1) * block_size)`.
    pub first_token: usize,
    /// Cache block ids of positions `start..start + block_ids.len()`.
    pub block_ids: Vec<usize>,
}

impl ScheduledGroup {
    /// A stable hash of what is checksummed (positions, tokens, block ids), which workers echo.
    pub fn digest(&self, num_tokens: usize) -> u64 {
        let mut h = Xxh3::new();
        for x in [
            self.group_id,
            self.block_size,
            self.start,
            self.first_token,
            num_tokens,
        ] {
            h.update(&(x as u64).to_le_bytes());
        }
        for &b in &self.block_ids {
            h.update(&(b as u64).to_le_bytes());
        }
        h.digest()
    }
}

/// What the scheduler asks every worker to checksum for one request.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ChecksumRequest {
    /// The request's token count: the last block covers only tokens before it.
    pub num_tokens: usize,
    pub groups: Vec<ScheduledGroup>,
    /// Groups the selection skipped (rule 3, or a block table too short).
    pub skipped: Vec<(usize, SkipReason)>,
}

impl ChecksumRequest {
    /// The producer's selection: the blocks holding the prompt's tokens `[0, num_tokens)`.
    pub fn for_send(num_tokens: usize, groups: &[GroupBlocks<'_>]) -> Self {
        Self::for_tokens(0, num_tokens, groups)
    }

    /// The consumer's selection: the blocks a load writes, tokens `[first_token, num_tokens)`.
    pub fn for_load(first_token: usize, num_tokens: usize, groups: &[GroupBlocks<'_>]) -> Self {
        Self::for_tokens(first_token, num_tokens, groups)
    }

    fn for_tokens(first_token: usize, num_tokens: usize, groups: &[GroupBlocks<'_>]) -> Self {
        let mut req = ChecksumRequest {
            num_tokens,
            ..Default::default()
        };
        for g in groups {
            match select_blocks(g, first_token, num_tokens) {
                Ok(Some(s)) => req.groups.push(s),
                Ok(None) => {}
                Err(reason) => req.skipped.push((g.group_id, reason)),
            }
        }
        req
    }

    /// Whether nothing is to be checksummed or compared.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty() && self.skipped.is_empty()
    }
}

/// Applies the selection rules (module docs) to one group. `Ok(None)`: no block to checksum.
pub fn select_blocks(
    g: &GroupBlocks<'_>,
    first_token: usize,
    num_tokens: usize,
) -> Result<Option<ScheduledGroup>, SkipReason> {
    let bs = g.spec.block_size();
    if bs == 0 || first_token >= num_tokens {
        return Ok(None);
    }
    let mut first = first_token / bs;
    let end = num_tokens.div_ceil(bs);
    if let Some(keep) = g.spec.blocks_to_keep() {
        first = first.max(end.saturating_sub(keep));
    }
    let table_end = g.first_position.saturating_add(g.blocks.len());
    if first < g.first_position || end > table_end {
        return Err(SkipReason::BlockTableTooShort);
    }
    let range = &g.blocks[first - g.first_position..end - g.first_position];
    let leading_nulls = range.iter().take_while(|b| b.is_none()).count();
    let kept = &range[leading_nulls..];
    if kept.is_empty() {
        return Ok(None);
    }
    let block_ids: Option<Vec<usize>> = kept.iter().copied().collect();
    let Some(block_ids) = block_ids else {
        return Err(SkipReason::NullBlockAfterNonNull);
    };
    let start = first + leading_nulls;
    Ok(Some(ScheduledGroup {
        group_id: g.group_id,
        block_size: bs,
        start,
        first_token: first_token.max(start * bs),
        block_ids,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_cache::CacheDtype;

    fn full(bs: usize) -> KvCacheSpec {
        KvCacheSpec::FullAttention {
            block_size: bs,
            num_kv_heads: 1,
            head_dim: 8,
            dtype: CacheDtype::F32,
        }
    }

    fn window(bs: usize, window: usize) -> KvCacheSpec {
        KvCacheSpec::SlidingWindow {
            block_size: bs,
            num_kv_heads: 1,
            head_dim: 8,
            dtype: CacheDtype::F32,
            window,
        }
    }

    fn sel(
        spec: &KvCacheSpec,
        blocks: &[BlockId],
        first: usize,
        n: usize,
    ) -> Result<Option<ScheduledGroup>, SkipReason> {
        select_blocks(
            &GroupBlocks {
                group_id: 0,
                spec,
                first_position: 0,
                blocks,
            },
            first,
            n,
        )
    }

    #[test]
    fn full_attention_takes_every_block_of_the_tokens() {
        let blocks: Vec<BlockId> = (10..15).map(Some).collect();
        let s = sel(&full(4), &blocks, 0, 17).unwrap().unwrap();
        assert_eq!((s.start, s.first_token), (0, 0));
        assert_eq!(s.block_ids, vec![10, 11, 12, 13, 14]);
        // a load after an 8-token prefix hit: only the loaded blocks
        let s = sel(&full(4), &blocks, 8, 17).unwrap().unwrap();
        assert_eq!((s.start, s.first_token), (2, 8));
        assert_eq!(s.block_ids, vec![12, 13, 14]);
        // no tokens: nothing
        assert_eq!(sel(&full(4), &blocks, 17, 17).unwrap(), None);
    }

    #[test]
    fn leading_nulls_out_null_after_non_null_skips() {
        let blocks = [None, None, Some(3), Some(4)];
        let s = sel(&full(4), &blocks, 0, 16).unwrap().unwrap();
        assert_eq!((s.start, s.first_token), (2, 8));
        assert_eq!(s.block_ids, vec![3, 4]);
        let blocks = [Some(1), None, Some(3), Some(4)];
        assert_eq!(
            sel(&full(4), &blocks, 0, 16),
            Err(SkipReason::NullBlockAfterNonNull)
        );
        assert_eq!(sel(&full(4), &[None, None], 0, 8).unwrap(), None);
    }

    #[test]
    fn sliding_window_keeps_its_last_blocks() {
        // window 5, block 4: cdiv(5, 4) + 1 = 3 blocks
        let blocks: Vec<BlockId> = [None, Some(1), Some(2), Some(3), Some(4), Some(5)].to_vec();
        let s = sel(&window(4, 5), &blocks, 0, 23).unwrap().unwrap();
        assert_eq!((s.start, s.first_token), (3, 12));
        assert_eq!(s.block_ids, vec![3, 4, 5]);
        // the clip comes before the null rules: a null outside the kept blocks is harmless
        let blocks: Vec<BlockId> = [Some(0), None, Some(2), Some(3), Some(4), Some(5)].to_vec();
        assert!(sel(&window(4, 5), &blocks, 0, 23).unwrap().is_some());
    }

    #[test]
    fn a_short_table_skips() {
        assert_eq!(
            sel(&full(4), &[Some(1)], 0, 8),
            Err(SkipReason::BlockTableTooShort)
        );
    }
}
