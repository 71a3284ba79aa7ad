//! The element type of the KV cache, and conversions between it and f32.
//!
//! Invariant: the bytes in the cache are the little-endian encoding of this type;
//! checksums are defined over these bytes, so a conversion must be deterministic.

use half::{bf16, f16};

/// Element type of K and V in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheDtype {
    F32,
    F16,
    Bf16,
}

impl CacheDtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            CacheDtype::F32 => 4,
            CacheDtype::F16 | CacheDtype::Bf16 => 2,
        }
    }

    /// The name used on the command line and in fingerprints.
    pub const fn name(self) -> &'static str {
        match self {
            CacheDtype::F32 => "f32",
            CacheDtype::F16 => "f16",
            CacheDtype::Bf16 => "bf16",
        }
    }

    /// Parses `f32`, `f16`/`float16`/`half`, `bf16`/`bfloat16`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => Some(CacheDtype::F32),
            "f16" | "float16" | "half" => Some(CacheDtype::F16),
            "bf16" | "bfloat16" => Some(CacheDtype::Bf16),
            _ => None,
        }
    }

    /// Encodes `src` into `dst` (which holds `src.len() * self.size()` bytes).
    pub fn encode(self, src: &[f32], dst: &mut [u8]) {
        debug_assert_eq!(dst.len(), src.len() * self.size());
        match self {
            CacheDtype::F32 => {
                for (d, s) in dst.chunks_exact_mut(4).zip(src) {
                    d.copy_from_slice(&s.to_le_bytes());
                }
            }
            CacheDtype::F16 => {
                for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                    d.copy_from_slice(&f16::from_f32(*s).to_le_bytes());
                }
            }
            CacheDtype::Bf16 => {
                for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                    d.copy_from_slice(&bf16::from_f32(*s).to_le_bytes());
                }
            }
        }
    }

    /// Decodes `src` bytes into `dst` f32 values.
    pub fn decode(self, src: &[u8], dst: &mut [f32]) {
        debug_assert_eq!(src.len(), dst.len() * self.size());
        match self {
            CacheDtype::F32 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                }
            }
            CacheDtype::F16 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = f16::from_le_bytes([s[0], s[1]]).to_f32();
                }
            }
            CacheDtype::Bf16 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = bf16::from_le_bytes([s[0], s[1]]).to_f32();
                }
            }
        }
    }
}

impl std::fmt::Display for CacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_is_exact_for_representable_values() {
        let vals = [0.0f32, 1.0, -2.5, 0.125, 65504.0];
        for dt in [CacheDtype::F32, CacheDtype::F16, CacheDtype::Bf16] {
            let mut bytes = vec![0u8; vals.len() * dt.size()];
            dt.encode(&vals, &mut bytes);
            let mut back = vec![0f32; vals.len()];
            dt.decode(&bytes, &mut back);
            for (a, b) in vals.iter().zip(&back) {
                if dt == CacheDtype::Bf16 && *a == 65504.0 {
                    continue; // not representable in bf16
                }
                assert_eq!(a, b, "{dt}");
            }
        }
    }
}
