//! The physical layout of one layer's K and V caches, and byte views of their blocks.
//!
//! K and V are separate arrays of the same shape. A *cache block* holds `block_size` tokens.
//! It may be stored as `block_size / kernel_block_size` consecutive *kernel blocks* (attention
//! kernels that want smaller pages); either way cache block `b` occupies bytes
//! `[b * block_bytes, (b + 1) * block_bytes)` of each array, so a transfer can address it alone.
//! Within a kernel block the order is:
//! - [`LayoutOrder::TokenMajor`]: `[kernel_block_size, num_kv_heads, head_dim]`
//! - [`LayoutOrder::HeadMajor`]: `[num_kv_heads, kernel_block_size, head_dim]`
//!
//! Elements are little-endian [`CacheDtype`] values.

use crate::dtype::CacheDtype;
use crate::error::KvCacheError;

/// Order of tokens and heads within a kernel block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayoutOrder {
    TokenMajor,
    HeadMajor,
}

/// Shape and order of one layer's K (or V) cache array.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockLayout {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Tokens per kernel block; equals `block_size` when blocks are not split.
    pub kernel_block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: CacheDtype,
    pub order: LayoutOrder,
}

impl BlockLayout {
    /// A token-major layout without kernel-block split, as [`crate::KvStorage`] allocates.
    pub fn token_major(
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
        dtype: CacheDtype,
    ) -> Self {
        BlockLayout {
            num_blocks,
            block_size,
            kernel_block_size: block_size,
            num_kv_heads,
            head_dim,
            dtype,
            order: LayoutOrder::TokenMajor,
        }
    }

    /// Checks that the shape is usable: non-zero sizes and kernel blocks that tile a block.
    pub fn validate(&self) -> Result<(), KvCacheError> {
        if self.block_size == 0 || self.num_kv_heads == 0 || self.head_dim == 0 {
            return Err(KvCacheError::InvalidConfig(format!(
                "block_size, num_kv_heads and head_dim must be non-zero: {self:?}"
            )));
        }
        if self.kernel_block_size == 0 || !self.block_size.is_multiple_of(self.kernel_block_size) {
            return Err(KvCacheError::InvalidConfig(format!(
                "kernel block size {} does not tile block size {}",
                self.kernel_block_size, self.block_size
            )));
        }
        Ok(())
    }

    /// Bytes of one head's row (one token): `head_dim * dtype size`.
    pub fn row_bytes(&self) -> usize {
        self.head_dim * self.dtype.size()
    }
    /// Bytes of one cache block of one array (K or V).
    pub fn block_bytes(&self) -> usize {
        self.block_size * self.num_kv_heads * self.row_bytes()
    }
    /// Bytes of the whole array.
    pub fn total_bytes(&self) -> usize {
        self.num_blocks * self.block_bytes()
    }
    /// Byte offset of the row of `head` for token `token` (0-based within the block) of `block`.
    #[inline]
    pub fn row_offset(&self, block: usize, token: usize, head: usize) -> usize {
        let kbs = self.kernel_block_size;
        let kernel_block = block * (self.block_size / kbs) + token / kbs;
        let t = token % kbs;
        let kernel_block_bytes = kbs * self.num_kv_heads * self.row_bytes();
        let within = match self.order {
            LayoutOrder::TokenMajor => (t * self.num_kv_heads + head) * self.row_bytes(),
            LayoutOrder::HeadMajor => (head * kbs + t) * self.row_bytes(),
        };
        kernel_block * kernel_block_bytes + within
    }
}

/// A read-only view of one layer's K and V caches.
#[derive(Debug, Clone, Copy)]
pub struct LayerKv<'a> {
    pub k: &'a [u8],
    pub v: &'a [u8],
    pub layout: BlockLayout,
}

impl<'a> LayerKv<'a> {
    /// Builds a view, checking that both arrays hold exactly `layout.total_bytes()`.
    pub fn new(k: &'a [u8], v: &'a [u8], layout: BlockLayout) -> Result<Self, KvCacheError> {
        layout.validate()?;
        for arr in [k, v] {
            if arr.len() != layout.total_bytes() {
                return Err(KvCacheError::LengthMismatch {
                    expected: layout.total_bytes(),
                    got: arr.len(),
                });
            }
        }
        Ok(LayerKv { k, v, layout })
    }

    fn check_block(&self, block: usize) -> Result<(), KvCacheError> {
        if block >= self.layout.num_blocks {
            return Err(KvCacheError::BlockOutOfRange {
                block,
                num_blocks: self.layout.num_blocks,
            });
        }
        Ok(())
    }

    /// The bytes of cache block `block` of K and of V.
    pub fn block(&self, block: usize) -> Result<(&'a [u8], &'a [u8]), KvCacheError> {
        self.check_block(block)?;
        let bb = self.layout.block_bytes();
        let r = block * bb..(block + 1) * bb;
        Ok((&self.k[r.clone()], &self.v[r]))
    }

    /// The K row and V row of `head` for token `token` of `block`.
    #[inline]
    pub fn rows(&self, block: usize, token: usize, head: usize) -> (&'a [u8], &'a [u8]) {
        let off = self.layout.row_offset(block, token, head);
        let rb = self.layout.row_bytes();
        (&self.k[off..off + rb], &self.v[off..off + rb])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_a_block_stay_inside_it() {
        for order in [LayoutOrder::TokenMajor, LayoutOrder::HeadMajor] {
            for kbs in [16, 8, 4] {
                let l = BlockLayout {
                    num_blocks: 3,
                    block_size: 16,
                    kernel_block_size: kbs,
                    num_kv_heads: 2,
                    head_dim: 4,
                    dtype: CacheDtype::F32,
                    order,
                };
                let mut seen = std::collections::HashSet::new();
                for b in 0..3 {
                    for t in 0..16 {
                        for h in 0..2 {
                            let off = l.row_offset(b, t, h);
                            assert!(off >= b * l.block_bytes());
                            assert!(off + l.row_bytes() <= (b + 1) * l.block_bytes());
                            assert!(seen.insert(off), "two rows share an offset");
                        }
                    }
                }
            }
        }
    }
}
