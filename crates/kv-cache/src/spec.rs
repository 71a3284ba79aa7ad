//! KV cache groups and their specs.
//!
//! A group is a set of layers that share one block table per request: every layer of a group
//! has the same spec, and a block id of the group addresses the same token positions in each
//! of its layers. Full-attention layers keep every block of a request; sliding-window layers
//! need only the last `window` tokens, so transfers and checksums keep their last
//! `cdiv(window, block_size) + 1` blocks (see [`KvCacheSpec::blocks_to_keep`]).

use crate::dtype::CacheDtype;

/// What one layer's KV cache holds, and how blocks of it are used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvCacheSpec {
    /// Every token attends to every earlier token.
    FullAttention {
        block_size: usize,
        /// KV heads held by this worker.
        num_kv_heads: usize,
        head_dim: usize,
        dtype: CacheDtype,
    },
    /// Every token attends to the `window` tokens before it (itself included).
    SlidingWindow {
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
        dtype: CacheDtype,
        window: usize,
    },
}

impl KvCacheSpec {
    pub fn block_size(&self) -> usize {
        match *self {
            KvCacheSpec::FullAttention { block_size, .. }
            | KvCacheSpec::SlidingWindow { block_size, .. } => block_size,
        }
    }
    pub fn num_kv_heads(&self) -> usize {
        match *self {
            KvCacheSpec::FullAttention { num_kv_heads, .. }
            | KvCacheSpec::SlidingWindow { num_kv_heads, .. } => num_kv_heads,
        }
    }
    pub fn head_dim(&self) -> usize {
        match *self {
            KvCacheSpec::FullAttention { head_dim, .. }
            | KvCacheSpec::SlidingWindow { head_dim, .. } => head_dim,
        }
    }
    pub fn dtype(&self) -> CacheDtype {
        match *self {
            KvCacheSpec::FullAttention { dtype, .. } | KvCacheSpec::SlidingWindow { dtype, .. } => {
                dtype
            }
        }
    }
    /// The sliding window, if any.
    pub fn window(&self) -> Option<usize> {
        match *self {
            KvCacheSpec::FullAttention { .. } => None,
            KvCacheSpec::SlidingWindow { window, .. } => Some(window),
        }
    }
    /// A short name of the spec type, used in fingerprints.
    pub fn type_name(&self) -> &'static str {
        match self {
            KvCacheSpec::FullAttention { .. } => "full_attention",
            KvCacheSpec::SlidingWindow { .. } => "sliding_window",
        }
    }
    /// Bytes of K plus V for one token of one layer on this worker.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_kv_heads() * self.head_dim() * self.dtype().size()
    }
    /// Bytes of K plus V for one block of one layer on this worker.
    pub fn bytes_per_block(&self) -> usize {
        self.bytes_per_token() * self.block_size()
    }
    /// How many trailing blocks of a request a transfer (and its checksum) keeps:
    /// all of them for full attention, `cdiv(window, block_size) + 1` for a sliding window.
    pub fn blocks_to_keep(&self) -> Option<usize> {
        self.window().map(|w| w.div_ceil(self.block_size()) + 1)
    }
}

/// A set of layers sharing one block table per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheGroup {
    pub group_id: usize,
    pub spec: KvCacheSpec,
    /// Layer names, e.g. `model.layers.3.self_attn`; the checksum takes the layer number from them.
    pub layer_names: Vec<String>,
}

/// The KV cache of one worker: how many blocks, and which groups share them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheConfig {
    pub num_blocks: usize,
    pub groups: Vec<KvCacheGroup>,
}

impl KvCacheConfig {
    /// Bytes of memory that `num_blocks` blocks of every layer take.
    pub fn bytes_per_block_all_layers(&self) -> usize {
        self.groups
            .iter()
            .map(|g| g.spec.bytes_per_block() * g.layer_names.len())
            .sum()
    }
    /// The block size shared by all groups (the engine uses one block size).
    pub fn block_size(&self) -> usize {
        self.groups
            .first()
            .map(|g| g.spec.block_size())
            .unwrap_or(16)
    }
    /// Layer names in order of their index in the storage.
    pub fn layer_names(&self) -> impl Iterator<Item = &str> {
        self.groups
            .iter()
            .flat_map(|g| g.layer_names.iter().map(String::as_str))
    }
}

/// Parses the layer number out of a layer name: the first integer component
/// (`model.layers.12.self_attn` -> 12, `blk.3.attn` -> 3). `None` when there is none.
pub fn layer_number(name: &str) -> Option<u32> {
    name.split(['.', '_', '/'])
        .find_map(|part| part.parse::<u32>().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_clip_keeps_cdiv_plus_one() {
        let s = KvCacheSpec::SlidingWindow {
            block_size: 16,
            num_kv_heads: 1,
            head_dim: 8,
            dtype: CacheDtype::F32,
            window: 512,
        };
        assert_eq!(s.blocks_to_keep(), Some(33));
        let s = KvCacheSpec::SlidingWindow {
            block_size: 16,
            num_kv_heads: 1,
            head_dim: 8,
            dtype: CacheDtype::F32,
            window: 20,
        };
        assert_eq!(s.blocks_to_keep(), Some(3));
    }

    #[test]
    fn layer_numbers_come_from_names() {
        assert_eq!(layer_number("model.layers.12.self_attn"), Some(12));
        assert_eq!(layer_number("blk.3.attn"), Some(3));
        assert_eq!(layer_number("lm_head"), None);
    }
}
