//! A Q8_0 matrix as the file stores it (ggml's `block_q8_0`, 34 bytes per 32 values: f16
//! scale `d`, then 32 `i8`; value = `d · q`; a row is `cols / 32` blocks): SmolLM2's tied
//! embedding / lm_head before `super::grouped` regroups it for `--dtype native-i8`.
//!
//! Invariant: the bytes are the file's, checked for size at construction.

use half::f16;

use super::QK;
use crate::error::ModelError;

/// Bytes per block: `d` (f16) and 32 `i8`.
const BLOCK_BYTES: usize = 34;

/// A `[rows, cols]` Q8_0 matrix (rows = output features).
#[derive(Debug, Clone)]
pub struct Q8_0Matrix {
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
}

impl Q8_0Matrix {
    pub fn new(rows: usize, cols: usize, bytes: Vec<u8>) -> Result<Self, ModelError> {
        if !cols.is_multiple_of(QK) || bytes.len() != rows * cols / QK * BLOCK_BYTES {
            return Err(ModelError::format(format!(
                "Q8_0 matrix [{rows}, {cols}] given {} bytes",
                bytes.len()
            )));
        }
        Ok(Q8_0Matrix { rows, cols, bytes })
    }

    /// Rows, columns and the file's bytes (for the grouped form, `super::grouped`).
    pub(super) fn parts(&self) -> (usize, usize, &[u8]) {
        (self.rows, self.cols, &self.bytes)
    }

    /// Bytes of the matrix in memory.
    pub fn size_in_bytes(&self) -> usize {
        self.bytes.len()
    }

    /// Rows `ids` as f32 (`[ids.len(), cols]`); every id must be `< rows`.
    pub fn dequantize_rows(&self, ids: &[u32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(ids.len() * self.cols);
        for &id in ids {
            let row_bytes = self.cols / QK * BLOCK_BYTES;
            for blk in self.bytes[id as usize * row_bytes..][..row_bytes].chunks_exact(BLOCK_BYTES)
            {
                let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                out.extend(blk[2..].iter().map(|&q| f32::from(q as i8) * d));
            }
        }
        out
    }
}
