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

/// One cache block of K and of V as f32 values.
pub type F32Block<'a> = (&'a [f32], &'a [f32]);

/// A read view of one layer's K and V arrays that hands out references to single blocks or rows
/// only, never to a whole array.
///
/// Soundness: the arrays are shared memory that other threads (the forward pass, NIXL, the
/// checksum thread) write while this view exists, each into blocks it owns. A `&[u8]` over a
/// whole array would assert that none of its bytes changes while it lives, which those writes
/// break (undefined behaviour even when they touch other bytes). So the view holds raw pointers,
/// and a reference is created only over the block or row asked for, which the caller must own for
/// the reference's lifetime (the storage's block-ownership invariant): nobody writes it meanwhile.
#[derive(Debug, Clone, Copy)]
pub struct LayerKv<'a> {
    k: *const u8,
    v: *const u8,
    /// Bytes of each of the two arrays.
    len: usize,
    pub layout: BlockLayout,
    _memory: std::marker::PhantomData<&'a [std::cell::UnsafeCell<u8>]>,
}

// SAFETY: the view only reads, and every reference it creates covers memory its caller owns
// (see the type's docs); the pointers stay valid for 'a.
unsafe impl Send for LayerKv<'_> {}
unsafe impl Sync for LayerKv<'_> {}

impl<'a> LayerKv<'a> {
    /// Builds a view over two slices, checking that both hold exactly `layout.total_bytes()`.
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
        Ok(LayerKv {
            k: k.as_ptr(),
            v: v.as_ptr(),
            len: k.len(),
            layout,
            _memory: std::marker::PhantomData,
        })
    }

    /// A view over two arrays of `len` bytes that live for `'a`.
    ///
    /// # Safety
    /// `k` and `v` point to `len` initialized bytes each, valid (not freed, not moved) for `'a`,
    /// 8-byte aligned, and `len >= layout.total_bytes()`.
    pub(crate) unsafe fn from_raw(
        k: *const u8,
        v: *const u8,
        len: usize,
        layout: BlockLayout,
    ) -> Self {
        LayerKv {
            k,
            v,
            len,
            layout,
            _memory: std::marker::PhantomData,
        }
    }

    /// Bytes of each of the two arrays.
    pub fn array_len(&self) -> usize {
        self.len
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

    /// `len` bytes of K and of V from byte `off`, bounds-checked against the arrays.
    #[inline]
    fn span(&self, off: usize, len: usize) -> (&'a [u8], &'a [u8]) {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len),
            "KV view: bytes {off}..+{len} outside an array of {}",
            self.len
        );
        // SAFETY: in bounds (checked above) of arrays valid for 'a; the caller owns the block
        // these bytes belong to, so nobody writes them while the references live.
        unsafe {
            (
                std::slice::from_raw_parts(self.k.add(off), len),
                std::slice::from_raw_parts(self.v.add(off), len),
            )
        }
    }

    /// The bytes of cache block `block` of K and of V. The caller must own the block.
    pub fn block(&self, block: usize) -> Result<(&'a [u8], &'a [u8]), KvCacheError> {
        self.check_block(block)?;
        let bb = self.layout.block_bytes();
        Ok(self.span(block * bb, bb))
    }

    /// Cache block `block` of K and of V as f32 values, when the cache dtype is f32 (the
    /// attention fast path). The caller must own the block.
    pub fn block_f32(&self, block: usize) -> Result<Option<F32Block<'a>>, KvCacheError> {
        if self.layout.dtype != CacheDtype::F32 {
            return Ok(None);
        }
        let (k, v) = self.block(block)?;
        // SAFETY: the arrays are 8-byte aligned and block_bytes is a multiple of 4 for f32, so
        // every block starts 4-byte aligned; f32 has no invalid bit patterns.
        let cast = |b: &'a [u8]| unsafe {
            std::slice::from_raw_parts(b.as_ptr() as *const f32, b.len() / 4)
        };
        Ok(Some((cast(k), cast(v))))
    }

    /// The K row and V row of `head` for token `token` of `block`. The caller must own the block.
    #[inline]
    pub fn rows(&self, block: usize, token: usize, head: usize) -> (&'a [u8], &'a [u8]) {
        let off = self.layout.row_offset(block, token, head);
        self.span(off, self.layout.row_bytes())
    }

    /// Copies of both whole arrays, block by block. The caller must own every block (tests,
    /// snapshots of an idle cache).
    pub fn to_vecs(&self) -> (Vec<u8>, Vec<u8>) {
        let (mut k, mut v) = (Vec::with_capacity(self.len), Vec::with_capacity(self.len));
        for b in 0..self.layout.num_blocks {
            let (kb, vb) = self.block(b).expect("in range");
            k.extend_from_slice(kb);
            v.extend_from_slice(vb);
        }
        (k, v)
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
