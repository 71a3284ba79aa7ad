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
use crate::cpu::isa_variants;

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
            d: vec![0.0; blocks],
            s: vec![0.0; blocks],
        };
        quantize_blocks(x, &mut rows.qs, &mut rows.d, &mut rows.s);
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

isa_variants! {
    /// Every block of `x`: `q = round_ties_even(x / d)` with `d = max|x| / 127` (0 for a zero
    /// block; NaNs count as 0 in the maximum and quantize to 0), and `s = d · Σq`. Written
    /// without float compares or saturating casts so the compiler vectorizes it in each
    /// variant.
    fn quantize_blocks(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32]) {
        // Adding 1.5 · 2^23 to |v| <= 2^22 rounds it to an integer, ties to even (the sum lies
        // in [2^23, 2^24), where f32 steps are 1), and the integer is the sum's bits
        // minus the constant's: equal to `round_ties_even` (tested). A NaN's bits give 0.
        const ROUND: f32 = 12_582_912.0;
        const ROUND_BITS: i32 = 0x4B40_0000;
        for (((xb, qb), d), s) in x
            .chunks_exact(QK)
            .zip(qs.chunks_exact_mut(QK))
            .zip(d.iter_mut())
            .zip(s.iter_mut())
        {
            // |x| as bits orders as |x| does; NaNs (above infinity's bits) count as 0
            let amax_bits = xb.iter().fold(0u32, |a, v| {
                let b = v.to_bits() & 0x7FFF_FFFF;
                a.max(if b > 0x7F80_0000 { 0 } else { b })
            });
            let dq = f32::from_bits(amax_bits) / 127.0;
            let id = if dq > 0.0 { 1.0 / dq } else { 0.0 };
            let mut sum = 0i32;
            for (qi, &xi) in qb.iter_mut().zip(xb) {
                // |xi · id| <= 127 up to rounding
                *qi = ((xi * id + ROUND).to_bits() as i32 - ROUND_BITS) as i8;
                sum += i32::from(*qi);
            }
            *d = dq;
            *s = dq * sum as f32;
        }
    }
}

/// Rows of a [`Q8Rows`] as a tile kernel reads them.
#[derive(Clone, Copy)]
pub(super) struct Q8View<'a> {
    pub(super) qs: &'a [i8],
    pub(super) d: &'a [f32],
    pub(super) s: &'a [f32],
}

impl Q8View<'_> {
    /// Where rows `rows` start: their quantized values (`k` a row) and their blocks' scales and
    /// sums (`nb` a row), bounds-checked once here so that a kernel's inner loop walks them by
    /// offset.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn row_ptrs(
        &self,
        rows: std::ops::Range<usize>,
        k: usize,
        nb: usize,
    ) -> (*const i8, *const f32, *const f32) {
        let span = |per_row: usize| rows.start * per_row..rows.end * per_row;
        (
            self.qs[span(k)].as_ptr(),
            self.d[span(nb)].as_ptr(),
            self.s[span(nb)].as_ptr(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_rounds_ties_to_even_and_zeroes_nans() {
        use crate::cpu::{on_this_thread, Isa};
        // d = 127 / 127 = 1: the values are their own steps, ties included
        let mut x = vec![0f32; 64];
        x[0] = 127.0;
        for (i, v) in [0.5f32, 1.5, 2.5, -0.5, -2.5, 126.5, -3.49, 3.51]
            .iter()
            .enumerate()
        {
            x[1 + i] = *v;
        }
        x[32] = f32::NAN;
        x[33] = -2.0;
        x[34] = 0.75;
        for isa in Isa::runnable() {
            let q = on_this_thread(isa, || Q8Rows::quantize(&x, 64));
            assert_eq!(
                q.qs[..9],
                [127, 0, 2, 2, 0, -2, 126, -3, 4],
                "{isa:?}: ties to even"
            );
            assert_eq!(q.d[0], 1.0, "{isa:?}");
            // the NaN neither sets the scale nor leaves a value
            assert_eq!(q.d[1], 2.0 / 127.0, "{isa:?}");
            assert_eq!(q.qs[32..35], [0, -127, 48], "{isa:?}");
            assert_eq!(q.s[1], q.d[1] * (-127 + 48) as f32, "{isa:?}");
        }
    }

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
