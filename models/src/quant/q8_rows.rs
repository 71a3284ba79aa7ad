//! Activations quantized to 8 bits per block of 32 values ([`Q8Rows`]), as llama.cpp's `Q8_1`
//! inputs for Q4_1 (in Tandem's own form): what the grouped matrices' integer kernels multiply
//! (`super::grouped`, `--dtype native-i8` / `native-amx`).
//!
//! - Each block of 32 values of a row becomes 32 `i8` (`round_ties_even(x / d)`,
//!   `d = max|x| / 127`, so every value is in -127..=127), its scale `d` (f32) and
//!   `s = d · Σq` (f32, for a Q4_1 weight's minimum: `Σ_i (dw·qw_i + mw)·d·qa_i =
//!   dw·d·Σ_i qw_i·qa_i + mw·s`).
//!
//! Invariant: quantizing is per row, so a row's quantized form never depends on the other rows
//! of its batch.

use super::QK;

/// `m` rows of `k` values quantized to 8 bits per block of 32 (module docs).
#[derive(Debug, Clone)]
pub struct Q8Rows {
    pub(super) k: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
}

impl Q8Rows {
    /// Quantizes `x`, rows of `k` values (`k` a multiple of 32).
    pub fn quantize(x: &[f32], k: usize) -> Q8Rows {
        assert!(
            k.is_multiple_of(QK) && x.len().is_multiple_of(k.max(1)),
            "8-bit rows of {k} values from {}",
            x.len()
        );
        let blocks = x.len() / QK;
        let mut rows = Q8Rows {
            k,
            qs: vec![0; x.len()],
            d: Vec::with_capacity(blocks),
            s: Vec::with_capacity(blocks),
        };
        for (xb, qb) in x.chunks_exact(QK).zip(rows.qs.chunks_exact_mut(QK)) {
            let (d, s) = quantize_block(xb, qb);
            rows.d.push(d);
            rows.s.push(s);
        }
        rows
    }

    /// The number of rows.
    pub fn len(&self) -> usize {
        self.qs.len().checked_div(self.k).unwrap_or(0)
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.qs.is_empty()
    }

    pub(super) fn view(&self) -> Q8View<'_> {
        Q8View {
            qs: &self.qs,
            d: &self.d,
            s: &self.s,
        }
    }
}

/// One block: `q = round_ties_even(x / d)` with `d = max|x| / 127` (0 for a zero block), and
/// `(d, d · Σq)`.
fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    // Adding and subtracting 1.5 · 2^23 rounds |v| <= 2^22 to an integer, ties to even: the
    // sum lies in [2^23, 2^24), where f32 steps are 1. Equal to `round_ties_even` (tested), and
    // two adds where the plain x86-64 target calls libm's `rintf`.
    const ROUND: f32 = 12_582_912.0;
    let mut sum = 0i32;
    for (qi, &xi) in q.iter_mut().zip(x) {
        // |xi · id| <= 127 up to rounding; the cast saturates
        *qi = ((xi * id + ROUND) - ROUND) as i8;
        sum += i32::from(*qi);
    }
    (d, d * sum as f32)
}

/// Rows of a [`Q8Rows`] as a tile kernel reads them.
#[derive(Clone, Copy)]
pub(super) struct Q8View<'a> {
    pub(super) qs: &'a [i8],
    pub(super) d: &'a [f32],
    pub(super) s: &'a [f32],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn quantized_blocks_round_to_the_nearest_step() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.5) * 0.37).collect();
        let q = Q8Rows::quantize(&x, 64);
        assert_eq!(q.len(), 1);
        for b in 0..2 {
            let xb = &x[b * 32..][..32];
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert_eq!(q.d[b], amax / 127.0);
            let mut sum = 0;
            for i in 0..32 {
                let qi = i32::from(q.qs[b * 32 + i]);
                assert!(qi.abs() <= 127);
                // within half a step of the value
                assert!(
                    (qi as f32 * q.d[b] - xb[i]).abs() <= q.d[b] * 0.5001,
                    "{b} {i}"
                );
                assert_eq!(
                    qi as f32,
                    (xb[i] * (1.0 / q.d[b])).round_ties_even(),
                    "{b} {i}"
                );
                sum += qi;
            }
            assert_eq!(q.s[b], q.d[b] * sum as f32);
            assert!(q.qs[b * 32..][..32].iter().any(|&v| v.abs() == 127));
        }
        let zero = Q8Rows::quantize(&[0.0; 32], 32);
        assert_eq!((zero.d[0], zero.s[0]), (0.0, 0.0));
        assert!(zero.qs.iter().all(|&v| v == 0));
    }
}
