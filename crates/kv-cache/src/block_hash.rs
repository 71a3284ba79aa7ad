//! The hash chain that names a full block of a request by its tokens.
//!
//! `hash(block i) = H(hash(block i-1), tokens of block i, extra keys)`, so equal hashes mean equal
//! prefixes (up to a 2^-128 collision chance), not just equal blocks. Extra keys separate caches
//! that must not be shared (e.g. a LoRA adapter or a cache salt). Stable across processes.

use xxhash_rust::xxh3::xxh3_128;

/// Identity of a full block's content together with everything before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// Hashes one full block given its parent's hash (None for the first block).
    pub fn chain(parent: Option<BlockHash>, tokens: &[u32], extra_keys: &[u64]) -> BlockHash {
        let mut buf = Vec::with_capacity(17 + 4 * tokens.len() + 8 * extra_keys.len());
        match parent {
            Some(p) => {
                buf.push(1);
                buf.extend_from_slice(&p.0.to_le_bytes());
            }
            None => buf.push(0),
        }
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        for k in extra_keys {
            buf.extend_from_slice(&k.to_le_bytes());
        }
        BlockHash(xxh3_128(&buf))
    }

    /// The hashes of every full block of `tokens`.
    pub fn for_prefix(tokens: &[u32], block_size: usize, extra_keys: &[u64]) -> Vec<BlockHash> {
        let mut parent = None;
        tokens
            .chunks_exact(block_size)
            .map(|chunk| {
                let h = BlockHash::chain(parent, chunk, extra_keys);
                parent = Some(h);
                h
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_depends_on_the_whole_prefix() {
        let a = BlockHash::for_prefix(&[1, 2, 3, 4, 5, 6], 2, &[]);
        let b = BlockHash::for_prefix(&[9, 2, 3, 4, 5, 6], 2, &[]);
        assert_eq!(a.len(), 3);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        let c = BlockHash::for_prefix(&[1, 2, 3, 4, 5, 6], 2, &[7]);
        assert_ne!(a[0], c[0]);
        assert_eq!(a, BlockHash::for_prefix(&[1, 2, 3, 4, 5, 6, 7], 2, &[]));
    }
}
