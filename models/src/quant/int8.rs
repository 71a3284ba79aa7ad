//! The Q4_1 matmul with activations quantized to 8 bits: integer dot products per block, as
//! llama.cpp computes Q4_1 (its `Q8_1` activations), in Tandem's own form.
//!
//! - Activations ([`Q8Rows`]): each block of 32 values of a row becomes 32 `i8`
//!   (`round_ties_even(x / d)`, `d = max|x| / 127`), its scale `d` (f32) and `s = d · Σq` (f32,
//!   for the weights' minimum). Quantizing is per row, so a row's result never depends on the
//!   others in its batch.
//! - Per block of a weight row: value `i` is `dw · qw_i + mw`, so
//!   `w · x ≈ Σ_blocks dw·da · Σ_i qw_i·qa_i + mw · s`. The integer sums are exact; lane `l` of
//!   8 accumulates `fma(Σ_{i=4l..4l+4} qw_i·qa_i, dw·da, acc_l)` over blocks in order (the
//!   positions are the block's: low nibbles are values 0..16, high nibbles 16..32), the minimum
//!   term accumulates as `fma(mw, s, mins)`, and the result is the 8 lanes summed by the fixed
//!   tree (lane `l` + `l + 4`, then `+ 2`, `+ 1`) plus `mins`.
//! - Variants: portable Rust (the reference, fused multiply-adds) and AVX2 (`vpmaddubsw` of the
//!   unsigned nibbles with the signed activations, `vpmaddwd` into the 8 lanes; or one VNNI
//!   `vpdpbusd` where the CPU has it, `crate::cpu::Vnni`), which the AVX-512 variant runs as
//!   well; same operations in the same order, so bit-identical (tested with VNNI on and off).
//!
//! Invariant: as the f32 kernel's (module docs of `q4_1`): a row's outputs are bit-identical
//! alone or in any batch and in any tile shape.

#[cfg(target_arch = "x86_64")]
use super::int8_forms;
use super::{KernelSet, TileInput, TileKernel, BLOCK_BYTES, MT, QK};

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

impl TileInput for Q8View<'_> {
    fn rows(self, r0: usize, mt: usize, k: usize) -> Self {
        let nb = k / QK;
        Q8View {
            qs: &self.qs[r0 * k..(r0 + mt) * k],
            d: &self.d[r0 * nb..(r0 + mt) * nb],
            s: &self.s[r0 * nb..(r0 + mt) * nb],
        }
    }
}

impl super::Q4_1Matrix {
    /// `y = x Wᵀ` for the quantized rows `x`, with the variant of `isa` (which the CPU must run).
    pub fn matmul_q8_on(&self, isa: crate::cpu::Isa, x: &Q8Rows) -> Vec<f32> {
        assert_eq!(x.k, self.cols, "Q4_1 matmul input width");
        super::run::<Self, Q8View<'_>, Int8Kernels>(self, isa, x.view(), x.len())
    }

    /// [`Self::matmul_q8_on`] with [`crate::cpu::Isa::active`].
    pub fn matmul_q8(&self, x: &Q8Rows) -> Vec<f32> {
        self.matmul_q8_on(crate::cpu::Isa::active(), x)
    }
}

struct Int8Kernels;

impl KernelSet<Q8View<'_>> for Int8Kernels {
    type Portable = portable::Kernel;
    #[cfg(target_arch = "x86_64")]
    type Avx2 = int8_forms::Avx2<avx2::Q4_1Tile>;
    #[cfg(target_arch = "x86_64")]
    type Avx512 = int8_forms::Avx512<avx2::Q4_1Tile>;
}

/// Tile shape of both variants: up to 4 input rows; 4 weight rows for one or two input rows
/// (batch-1 decode reads four weight rows per pass), 2 for more (at most 8 accumulators).
pub(super) fn weight_rows(mt: usize, left: usize) -> usize {
    match (mt, left) {
        (_, 1) => 1,
        (1 | 2, 4..) => 4,
        _ => 2,
    }
}

/// Checks a tile's arguments once for both variants: `NR` weight rows of `nb` whole blocks,
/// `M` input rows of `nb` blocks. Returns `(k, nb)`.
fn tile_shape<const NR: usize, const M: usize>(
    rows: &[&[u8]; NR],
    xt: &Q8View<'_>,
) -> (usize, usize) {
    let k = xt.qs.len() / M;
    let nb = k / QK;
    assert!(M <= 4 && NR <= 4 && xt.qs.len() == M * k && k.is_multiple_of(QK));
    assert!(xt.d.len() == M * nb && xt.s.len() == M * nb);
    assert!(rows.iter().all(|r| r.len() == nb * BLOCK_BYTES));
    (k, nb)
}

/// `Σ_b fma(mw_b, s_b, ·)` over the blocks of weight row `row` and input row `r` of `xt`, in
/// block order: the minimum's share of the dot product, computed after the integer sums (it
/// needs no per-lane work, and out of the tile loop it costs no registers).
#[inline(always)]
fn min_term<const FUSED: bool>(row: &[u8], xt: &Q8View<'_>, r: usize, nb: usize) -> f32 {
    let s = &xt.s[r * nb..(r + 1) * nb];
    let mut sum = 0f32;
    for (blk, &sb) in row.chunks_exact(BLOCK_BYTES).zip(s) {
        let mw = half::f16::from_le_bytes([blk[2], blk[3]]).to_f32();
        sum = madd::<FUSED>(mw, sb, sum);
    }
    sum
}

/// `a * b + c`, rounded once when `FUSED` (the portable variant fuses only where the target has
/// FMA instructions, as the f32 kernel's: libm's exact `fmaf` costs ~100x).
#[inline(always)]
pub(super) fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// The reference in plain Rust (module docs).
mod portable {
    use super::{madd, min_term, tile_shape, Q8View, TileKernel, BLOCK_BYTES, MT, QK};
    use crate::quant::portable::HARDWARE_FMA;
    use crate::quant::scale_min;

    pub(in crate::quant) struct Kernel;

    impl TileKernel<Q8View<'_>> for Kernel {
        const INPUT_ROWS: usize = 4;

        #[inline(always)]
        fn weight_rows(mt: usize, left: usize) -> usize {
            super::weight_rows(mt, left)
        }

        #[inline(always)]
        unsafe fn tile<const NR: usize, const M: usize>(
            rows: [&[u8]; NR],
            xt: Q8View<'_>,
            sums: &mut [[f32; 4]; MT],
        ) {
            tile_with::<NR, M, HARDWARE_FMA>(rows, xt, sums)
        }
    }

    /// The reference: every multiply-add fused.
    #[cfg(test)]
    pub(in crate::quant) fn tile<const NR: usize, const M: usize>(
        rows: [&[u8]; NR],
        xt: Q8View<'_>,
        sums: &mut [[f32; 4]; MT],
    ) {
        tile_with::<NR, M, true>(rows, xt, sums)
    }

    // indexed as the module docs define the lanes
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    fn tile_with<const NR: usize, const M: usize, const FUSED: bool>(
        rows: [&[u8]; NR],
        xt: Q8View<'_>,
        sums: &mut [[f32; 4]; MT],
    ) {
        let (k, nb) = tile_shape::<NR, M>(&rows, &xt);
        let mut acc = [[[0f32; 8]; NR]; M];
        for b in 0..nb {
            let mut q = [[0i32; QK]; NR];
            let mut dm = [(0f32, 0f32); NR];
            for j in 0..NR {
                let blk = &rows[j][b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
                dm[j] = scale_min(blk);
                for i in 0..16 {
                    q[j][i] = i32::from(blk[4 + i] & 15);
                    q[j][16 + i] = i32::from(blk[4 + i] >> 4);
                }
            }
            for r in 0..M {
                let a = &xt.qs[r * k + b * QK..][..QK];
                let da = xt.d[r * nb + b];
                for j in 0..NR {
                    let dd = dm[j].0 * da;
                    for l in 0..8 {
                        let isum: i32 = (4 * l..4 * l + 4).map(|i| q[j][i] * i32::from(a[i])).sum();
                        acc[r][j][l] = madd::<FUSED>(isum as f32, dd, acc[r][j][l]);
                    }
                }
            }
        }
        for r in 0..M {
            for j in 0..NR {
                let mut p = acc[r][j];
                for s in [4, 2, 1] {
                    for i in 0..s {
                        p[i] += p[i + s];
                    }
                }
                sums[r][j] = p[0] + min_term::<FUSED>(rows[j], &xt, r, nb);
            }
        }
    }
}

/// AVX2 form of `portable::tile` (module docs), with the integer sums by `vpmaddubsw` +
/// `vpmaddwd` or, where the CPU has it, one VNNI `vpdpbusd` (`crate::cpu::Vnni`).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{tile_shape, Q8View, BLOCK_BYTES, MT, QK};
    use crate::ops::simd::reduce8;
    use crate::quant::int8_forms::{IntTile, EVEX, VEX};

    /// The Q4_1 tile in its x86 forms (`crate::quant::int8_forms`).
    pub(in crate::quant) struct Q4_1Tile;

    impl IntTile for Q4_1Tile {
        const PAIRS_IN_512: bool = true;

        #[inline(always)]
        unsafe fn tile<const NR: usize, const M: usize, const DOT: u8>(
            rows: [&[u8]; NR],
            xt: Q8View<'_>,
            sums: &mut [[f32; 4]; MT],
        ) {
            // SAFETY: the caller's contract.
            unsafe { tile_with::<NR, M, DOT>(rows, xt, sums) }
        }

        #[inline(always)]
        unsafe fn tile_512<const NR: usize, const M: usize, const DOT: u8>(
            rows: [&[u8]; NR],
            xt: Q8View<'_>,
            sums: &mut [[f32; 4]; MT],
        ) {
            // SAFETY: the caller's contract.
            unsafe { tile_512::<NR, M, DOT>(rows, xt, sums) }
        }
    }

    /// The AVX-512 tile: weight rows in pairs, row `2p` in the low 256 bits of a 512-bit
    /// register and row `2p + 1` in the high, so each instruction does two rows' work; lane
    /// for lane the arithmetic of [`tile_with`] (same lanes, operations and order), hence the
    /// same bits. `DOT` is `PAIR` (`vpmaddubsw` + `vpmaddwd`) or `EVEX` (`vpdpbusd`).
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C, and AVX512-VNNI for `EVEX`; `NR` is
    /// 2 or 4.
    #[inline(always)]
    unsafe fn tile_512<const NR: usize, const M: usize, const DOT: u8>(
        rows: [&[u8]; NR],
        xt: Q8View<'_>,
        sums: &mut [[f32; 4]; MT],
    ) {
        let (k, nb) = tile_shape::<NR, M>(&rows, &xt);
        assert!(NR == 2 || NR == 4);
        let pairs = NR / 2;
        // SAFETY: as `tile_with`'s (the same blocks and activations are read).
        unsafe {
            let low4 = _mm256_set1_epi8(15);
            let ones = _mm512_set1_epi16(1);
            let zero = _mm512_setzero_si512();
            let mut acc = [[_mm512_setzero_ps(); 2]; M];
            for b in 0..nb {
                let mut w = [zero; 2];
                let mut dw = [_mm512_setzero_ps(); 2];
                for p in 0..pairs {
                    let b0 = rows[2 * p].as_ptr().add(b * BLOCK_BYTES);
                    let b1 = rows[2 * p + 1].as_ptr().add(b * BLOCK_BYTES);
                    let q = _mm256_loadu2_m128i(b1.add(4).cast(), b0.add(4).cast());
                    let lo = _mm256_and_si256(q, low4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low4);
                    // [lo0, lo1, hi0, hi1] -> [lo0, hi0, lo1, hi1] (128-bit lanes)
                    let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                    w[p] = _mm512_shuffle_i64x2::<0b11_01_10_00>(z, z);
                    let d = |blk: *const u8| {
                        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(
                            blk.cast::<u16>().read_unaligned(),
                        )));
                        _mm256_broadcastss_ps(v)
                    };
                    dw[p] = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(d(b0)), d(b1));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let a = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        xt.qs.as_ptr().add(r * k + b * QK).cast(),
                    ));
                    let da = _mm512_set1_ps(*xt.d.get_unchecked(r * nb + b));
                    for p in 0..pairs {
                        let s = match DOT {
                            EVEX => _mm512_dpbusd_epi32(zero, w[p], a),
                            _ => _mm512_madd_epi16(_mm512_maddubs_epi16(w[p], a), ones),
                        };
                        let dd = _mm512_mul_ps(dw[p], da);
                        acc_r[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dd, acc_r[p]);
                    }
                }
            }
            let mins = min_terms::<NR, M>(&rows, &xt, nb);
            for r in 0..M {
                for j in 0..NR {
                    let v = acc[r][j / 2];
                    let v = if j % 2 == 0 {
                        _mm512_castps512_ps256(v)
                    } else {
                        _mm512_extractf32x8_ps::<1>(v)
                    };
                    sums[r][j] = reduce8(v) + mins[r][j];
                }
            }
        }
    }

    /// `min_term` for every (r, j) of a tile: lane `j` of one 4-lane register per input row
    /// runs row `j`'s chain (the same fused multiply-adds in block order).
    ///
    /// # Safety
    /// The CPU has AVX, FMA and F16C; the tile's shape was checked by `tile_shape`.
    #[inline(always)]
    unsafe fn min_terms<const NR: usize, const M: usize>(
        rows: &[&[u8]; NR],
        xt: &Q8View<'_>,
        nb: usize,
    ) -> [[f32; NR]; M] {
        // SAFETY: block `b < nb` of each row and `s[r * nb + b]`, `r < M`: in bounds by
        // `tile_shape`'s asserts (`NR <= 4`); the instructions by the caller's contract.
        unsafe {
            let mut acc = [_mm_setzero_ps(); M];
            for b in 0..nb {
                let m = |j: usize| {
                    if j < NR {
                        rows[j]
                            .as_ptr()
                            .add(b * BLOCK_BYTES + 2)
                            .cast::<i16>()
                            .read_unaligned()
                    } else {
                        0
                    }
                };
                let mw = _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, m(3), m(2), m(1), m(0)));
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let sb = _mm_set1_ps(*xt.s.get_unchecked(r * nb + b));
                    *acc_r = _mm_fmadd_ps(mw, sb, *acc_r);
                }
            }
            let mut mins = [[0f32; NR]; M];
            for (r, mins_r) in mins.iter_mut().enumerate() {
                let mut lanes = [0f32; 4];
                _mm_storeu_ps(lanes.as_mut_ptr(), acc[r]);
                mins_r.copy_from_slice(&lanes[..NR]);
            }
            mins
        }
    }

    /// The tile with the integer sums formed as `DOT` says.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C, and AVX-VNNI for `VEX`, AVX512-VNNI (with VL) for `EVEX`.
    #[inline(always)]
    unsafe fn tile_with<const NR: usize, const M: usize, const DOT: u8>(
        rows: [&[u8]; NR],
        xt: Q8View<'_>,
        sums: &mut [[f32; 4]; MT],
    ) {
        let (k, nb) = tile_shape::<NR, M>(&rows, &xt);
        // SAFETY: block `b < nb` of row `j` is read at bytes `b * 20..b * 20 + 20` of
        // `rows[j]` (length `nb * 20`), activations at `qs[r * k + b * 32..][..32]` and
        // `d`, `s` at `r * nb + b` with `r < M`: in bounds by `tile_shape`'s asserts. The
        // CPU has the instructions (the caller's contract).
        unsafe {
            let low4 = _mm_set1_epi8(15);
            let ones = _mm256_set1_epi16(1);
            let zero = _mm256_setzero_si256();
            let mut acc = [[_mm256_setzero_ps(); NR]; M];
            for b in 0..nb {
                let mut w = [_mm256_setzero_si256(); NR];
                let mut dw = [_mm256_setzero_ps(); NR];
                for j in 0..NR {
                    let blk = rows[j].as_ptr().add(b * BLOCK_BYTES);
                    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(
                        blk.cast::<u16>().read_unaligned(),
                    )));
                    dw[j] = _mm256_broadcastss_ps(v);
                    let q = _mm_loadu_si128(blk.add(4).cast());
                    let lo = _mm_and_si128(q, low4);
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), low4);
                    w[j] = _mm256_set_m128i(hi, lo);
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let a = _mm256_loadu_si256(xt.qs.as_ptr().add(r * k + b * QK).cast());
                    let da = _mm256_broadcast_ss(xt.d.get_unchecked(r * nb + b));
                    for j in 0..NR {
                        // lane l: Σ_{i=4l..4l+4} qw_i · qa_i, exact in every form
                        let p = match DOT {
                            VEX => _mm256_dpbusd_avx_epi32(zero, w[j], a),
                            EVEX => _mm256_dpbusd_epi32(zero, w[j], a),
                            _ => _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], a), ones),
                        };
                        let dd = _mm256_mul_ps(dw[j], da);
                        acc_r[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dd, acc_r[j]);
                    }
                }
            }
            let mins = min_terms::<NR, M>(&rows, &xt, nb);
            for r in 0..M {
                for j in 0..NR {
                    sums[r][j] = reduce8(acc[r][j]) + mins[r][j];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Isa;
    #[cfg(target_arch = "x86_64")]
    use crate::quant::int8_forms::assert_every_form_matches;
    use crate::quant::tests::{random_input, random_matrix};
    use crate::quant::BlockRows;

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

    /// f64 dot of the dequantized weights with the dequantized activations: what the kernel
    /// computes up to f32 rounding.
    fn naive(w: &crate::quant::Q4_1Matrix, x: &Q8Rows) -> Vec<f64> {
        let xf: Vec<f32> =
            x.qs.iter()
                .enumerate()
                .map(|(i, &q)| f32::from(q) * x.d[i / QK])
                .collect();
        let wf = w.dequantize_rows(&(0..w.rows as u32).collect::<Vec<_>>());
        let (k, m) = (x.k, x.len());
        let mut y = vec![0f64; m * w.rows];
        for r in 0..m {
            for o in 0..w.rows {
                y[r * w.rows + o] = (0..k)
                    .map(|c| f64::from(wf[o * k + c]) * f64::from(xf[r * k + c]))
                    .sum();
            }
        }
        y
    }

    #[test]
    fn matmul_matches_the_dequantized_dot_and_the_f32_kernel() {
        for (rows, cols) in [(37, 96), (1, 32), (67, 576), (130, 1536)] {
            let w = random_matrix(rows, cols, 17 + rows as u64);
            for m in [1, 2, 5, 16] {
                let x = random_input(m, cols, 19 + m as u64);
                let xq = Q8Rows::quantize(&x, cols);
                let want = naive(&w, &xq);
                let f32_kernel = w.matmul(&x, m);
                let scale = (cols as f64).sqrt() * 0.5;
                for isa in Isa::runnable() {
                    let got = w.matmul_q8_on(isa, &xq);
                    for (i, (&g, &e)) in got.iter().zip(&want).enumerate() {
                        let err = (f64::from(g) - e).abs() / e.abs().max(scale);
                        assert!(
                            err < 1e-4,
                            "{isa:?} [{rows}, {cols}] m={m} #{i}: {g} vs {e}"
                        );
                        // and close to the unquantized product (8-bit activations)
                        let full = f64::from(f32_kernel[i]);
                        let err = (f64::from(g) - full).abs() / full.abs().max(scale);
                        assert!(
                            err < 2e-2,
                            "{isa:?} [{rows}, {cols}] m={m} #{i}: {g} vs {full}"
                        );
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_integer_sum_form_equals_the_portable_tile_bit_for_bit() {
        // `vpmaddubsw` + `vpmaddwd`, AVX-VNNI and AVX512-VNNI, each where this CPU has it
        let cols = 576;
        let w = random_matrix(4, cols, 53);
        let x = random_input(4, cols, 55);
        let xq = Q8Rows::quantize(&x, cols);
        let rows4 = [w.row(0), w.row(1), w.row(2), w.row(3)];
        fn check<const NR: usize, const M: usize>(rows: [&[u8]; NR], xt: Q8View<'_>) -> usize {
            assert_every_form_matches::<avx2::Q4_1Tile, NR, M>(rows, xt, portable::tile::<NR, M>)
        }
        let v = xq.view();
        check::<1, 1>([rows4[0]], v.rows(0, 1, cols));
        let forms = check::<4, 1>(rows4, v.rows(1, 1, cols));
        check::<4, 2>(rows4, v.rows(0, 2, cols));
        check::<2, 3>([rows4[1], rows4[3]], v.rows(1, 3, cols));
        check::<2, 4>([rows4[2], rows4[0]], v.rows(0, 4, cols));
        eprintln!("integer sum forms run: {forms}");
    }

    #[test]
    fn every_variant_equals_the_portable_reference_bit_for_bit_in_any_batch() {
        // the portable variant is the reference only where the target has FMA (module docs)
        let runnable: Vec<Isa> = Isa::runnable()
            .into_iter()
            .filter(|&i| i != Isa::Portable || crate::quant::portable::HARDWARE_FMA)
            .collect();
        eprintln!("variants run: {runnable:?}");
        for (rows, cols) in [(11, 160), (75, 576), (4, 32), (130, 1536)] {
            let w = random_matrix(rows, cols, 23 + rows as u64);
            let x = random_input(13, cols, 29);
            let xq = Q8Rows::quantize(&x, cols);
            // the reference: one row and one weight row per tile
            let mut want = vec![0f32; 13 * rows];
            for r in 0..13 {
                let xr = xq.view().rows(r, 1, cols);
                for o in 0..rows {
                    let mut sums = [[0f32; 4]; MT];
                    portable::tile::<1, 1>([w.row(o)], xr, &mut sums);
                    want[r * rows + o] = sums[0][0];
                }
            }
            for &isa in &runnable {
                for m in [1, 2, 3, 4, 13] {
                    let xm = Q8Rows::quantize(&x[..m * cols], cols);
                    let got = w.matmul_q8_on(isa, &xm);
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            e.to_bits(),
                            "{isa:?} [{rows}, {cols}] m={m} #{i}"
                        );
                    }
                }
            }
        }
    }
}
