//! The constants and per-slice factors of the checksum definition, and group fingerprints.
//!
//! Owns: the piece size, the bound on KV heads per layer, the odd head factor
//! `m = 2 * (layer * 2^16 + head) + 1`, the piece weight `2j + 1`, and the stable hash of a layer
//! that fingerprints a group. Invariants: every factor and weight is odd (so invertible mod
//! 2^64); all arithmetic wraps mod 2^64; the fingerprint depends only on the layer's name, spec
//! type and dtype, never on the process, platform, run or PP split.

use tandem_kv_cache::CacheDtype;
use xxhash_rust::xxh3::xxh3_64;

/// Bytes per piece: slices are cut into little-endian `u64`s.
pub const PIECE_BYTES: usize = 8;

/// Fixed bound on any layer's KV heads (`H` in `m = 2 * (layer * H + head) + 1`).
pub const MAX_KV_HEADS_PER_LAYER: u64 = 1 << 16;

/// The odd factor of the slice of `layer` (its number from the layer name) and global KV `head`.
#[inline]
pub fn head_factor(layer: u32, head: u32) -> u64 {
    (layer as u64)
        .wrapping_mul(MAX_KV_HEADS_PER_LAYER)
        .wrapping_add(head as u64)
        .wrapping_mul(2)
        .wrapping_add(1)
}

/// The odd weight `2j + 1` of piece `j` (counted from the request's first token).
#[inline]
pub fn piece_weight(j: u64) -> u64 {
    j.wrapping_mul(2).wrapping_add(1)
}

/// Pieces per token of one head's slice (`P`): its K row and V row, or `None` when they are not
/// whole 8-byte pieces.
pub fn pieces_per_token(head_dim: usize, dtype: CacheDtype) -> Option<usize> {
    let bytes = 2 * head_dim * dtype.size();
    (bytes > 0 && bytes.is_multiple_of(PIECE_BYTES)).then_some(bytes / PIECE_BYTES)
}

/// The stable 64-bit hash of one layer's (name, spec type, dtype). A group's fingerprint is the
/// wrapping sum of it over the group's layers, so PP stages' fingerprints add up to the model's.
pub fn layer_fingerprint(name: &str, spec_type: &str, dtype: CacheDtype) -> u64 {
    let mut bytes = Vec::with_capacity(name.len() + spec_type.len() + 8);
    bytes.extend_from_slice(name.as_bytes());
    bytes.push(0);
    bytes.extend_from_slice(spec_type.as_bytes());
    bytes.push(0);
    bytes.extend_from_slice(dtype.name().as_bytes());
    xxh3_64(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factors_and_weights_are_odd_and_distinct() {
        assert_eq!(head_factor(0, 0), 1);
        assert_eq!(head_factor(0, 1), 3);
        assert_eq!(head_factor(1, 0), 2 * 65536 + 1);
        assert_ne!(head_factor(1, 0), head_factor(0, 65535));
        assert_eq!(piece_weight(0), 1);
        assert_eq!(piece_weight(u64::MAX), u64::MAX);
        assert_eq!(head_factor(u32::MAX, u32::MAX) % 2, 1);
    }

    #[test]
    fn pieces_need_whole_eight_bytes_per_token() {
        assert_eq!(pieces_per_token(64, CacheDtype::F32), Some(64));
        assert_eq!(pieces_per_token(2, CacheDtype::F16), Some(1));
        assert_eq!(pieces_per_token(3, CacheDtype::F16), None);
        assert_eq!(pieces_per_token(0, CacheDtype::F32), None);
    }

    #[test]
    fn fingerprint_is_a_fixed_function_of_its_inputs() {
        // A fixed value: it must not change across runs, platforms or releases, since producers
        // and consumers of different builds compare it.
        let a = layer_fingerprint(
            "model.layers.0.self_attn",
            "full_attention",
            CacheDtype::F32,
        );
        assert_eq!(
            a,
            layer_fingerprint(
                "model.layers.0.self_attn",
                "full_attention",
                CacheDtype::F32
            )
        );
        assert_ne!(
            a,
            layer_fingerprint(
                "model.layers.0.self_attn",
                "full_attention",
                CacheDtype::Bf16
            )
        );
        assert_ne!(
            a,
            layer_fingerprint(
                "model.layers.0.self_attn",
                "sliding_window",
                CacheDtype::F32
            )
        );
        assert_ne!(
            a,
            layer_fingerprint(
                "model.layers.1.self_attn",
                "full_attention",
                CacheDtype::F32
            )
        );
        assert_eq!(a, xxh3_64(b"model.layers.0.self_attn\0full_attention\0f32"));
    }
}
