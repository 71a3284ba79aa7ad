//! A Q8_0 matrix held as the file stores it (no padding, no rotation), multiplied by inputs
//! quantized to 8 bits ([`Q8Rows`]): SmolLM2's tied embedding / lm_head under
//! `--dtype native-i8`.
//!
//! - Layout (ggml's `block_q8_0`, 34 bytes per 32 values): f16 scale `d`, then 32 `i8`;
//!   value = `d · q`. A row is `cols / 32` blocks.
//! - Per block: `Σ_i qw_i·qa_i` is exact in integers; lane `l` of 8 accumulates
//!   `fma(Σ_{i=4l..4l+4} qw_i·qa_i, dw·da, acc_l)` over blocks in order, and the result is the 8
//!   lanes summed by the fixed tree (lane `l` + `l + 4`, then `+ 2`, `+ 1`): the Q4_1 int8
//!   kernel's arithmetic without its minimum term.
//! - Variants: portable Rust (the reference) and AVX2 (`vpsignb` moves the weight's sign onto
//!   the activation so `vpmaddubsw` multiplies `|qw|` (unsigned) by `±qa`, exact: |products|
//!   ≤ 128·127, pair sums < 2^15; or one VNNI `vpdpbusd` of the same operands where the CPU
//!   has it, `crate::cpu::Vnni`), which AVX-512 CPUs run too; bit-identical (tested with VNNI
//!   on and off).
//!
//! Invariant: a row's outputs are bit-identical alone or in any batch and tile shape.

use half::f16;

use super::int8::{madd, weight_rows, Q8View};
#[cfg(target_arch = "x86_64")]
use super::int8_forms;
use super::{BlockRows, KernelSet, TileKernel, MT, QK};
use crate::cpu::Isa;
use crate::error::ModelError;
use crate::quant::Q8Rows;

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

    /// Rows, columns and the file's bytes (for the AMX form, `super::amx`).
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
            for blk in self.row(id as usize).chunks_exact(BLOCK_BYTES) {
                let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                out.extend(blk[2..].iter().map(|&q| f32::from(q as i8) * d));
            }
        }
        out
    }

    /// `y = x Wᵀ` for the quantized rows `x`, with the variant of `isa` (which the CPU must run).
    pub fn matmul_q8_on(&self, isa: Isa, x: &Q8Rows) -> Vec<f32> {
        assert_eq!(x.k, self.cols, "Q8_0 matmul input width");
        super::run::<Self, Q8View<'_>, Kernels>(self, isa, x.view(), x.len())
    }

    /// [`Self::matmul_q8_on`] with [`Isa::active`].
    pub fn matmul_q8(&self, x: &Q8Rows) -> Vec<f32> {
        self.matmul_q8_on(Isa::active(), x)
    }
}

impl BlockRows for Q8_0Matrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn row(&self, r: usize) -> &[u8] {
        let rb = self.cols / QK * BLOCK_BYTES;
        &self.bytes[r * rb..(r + 1) * rb]
    }
}

struct Kernels;

impl KernelSet<Q8View<'_>> for Kernels {
    type Portable = portable::Kernel;
    #[cfg(target_arch = "x86_64")]
    type Avx2 = int8_forms::Avx2<avx2::Q8_0Tile>;
    // AVX-512 CPUs run the 256-bit tile too (compiled with their wider feature set, and VNNI).
    #[cfg(target_arch = "x86_64")]
    type Avx512 = int8_forms::Avx512<avx2::Q8_0Tile>;
}

/// Checks a tile's arguments once for both variants. Returns `(k, nb)`.
fn tile_shape<const NR: usize, const M: usize>(
    rows: &[&[u8]; NR],
    xt: &Q8View<'_>,
) -> (usize, usize) {
    let k = xt.qs.len() / M;
    let nb = k / QK;
    assert!(M <= 4 && NR <= 4 && xt.qs.len() == M * k && k.is_multiple_of(QK));
    assert!(xt.d.len() == M * nb);
    assert!(rows.iter().all(|r| r.len() == nb * BLOCK_BYTES));
    (k, nb)
}

/// The reference in plain Rust (module docs).
mod portable {
    use super::{madd, tile_shape, Q8View, TileKernel, BLOCK_BYTES, MT, QK};
    use crate::quant::portable::HARDWARE_FMA;

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
            for r in 0..M {
                let a = &xt.qs[r * k + b * QK..][..QK];
                let da = xt.d[r * nb + b];
                for j in 0..NR {
                    let blk = &rows[j][b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
                    let dw = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    let dd = dw * da;
                    for l in 0..8 {
                        let isum: i32 = (4 * l..4 * l + 4)
                            .map(|i| i32::from(blk[2 + i] as i8) * i32::from(a[i]))
                            .sum();
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
                sums[r][j] = p[0];
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

    /// The Q8_0 tile in its x86 forms (`crate::quant::int8_forms`).
    pub(in crate::quant) struct Q8_0Tile;

    impl IntTile for Q8_0Tile {
        #[inline(always)]
        unsafe fn tile<const NR: usize, const M: usize, const DOT: u8>(
            rows: [&[u8]; NR],
            xt: Q8View<'_>,
            sums: &mut [[f32; 4]; MT],
        ) {
            // SAFETY: the caller's contract.
            unsafe { tile_with::<NR, M, DOT>(rows, xt, sums) }
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
        // SAFETY: block `b < nb` of row `j` is read at bytes `b * 34..b * 34 + 34` of
        // `rows[j]` (length `nb * 34`), activations at `qs[r * k + b * 32..][..32]` and `d`
        // at `r * nb + b` with `r < M`: in bounds by `tile_shape`'s asserts. The CPU has the
        // instructions (the caller's contract).
        unsafe {
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
                    w[j] = _mm256_loadu_si256(blk.add(2).cast());
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let a = _mm256_loadu_si256(xt.qs.as_ptr().add(r * k + b * QK).cast());
                    let da = _mm256_broadcast_ss(xt.d.get_unchecked(r * nb + b));
                    for j in 0..NR {
                        // |qw| (unsigned) times ±qa: exact in every form (module docs)
                        let aw = _mm256_sign_epi8(w[j], w[j]);
                        let sa = _mm256_sign_epi8(a, w[j]);
                        let p = match DOT {
                            VEX => _mm256_dpbusd_avx_epi32(zero, aw, sa),
                            EVEX => _mm256_dpbusd_epi32(zero, aw, sa),
                            _ => _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), ones),
                        };
                        let dd = _mm256_mul_ps(dw[j], da);
                        acc_r[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dd, acc_r[j]);
                    }
                }
            }
            for r in 0..M {
                for j in 0..NR {
                    // the portable tree: lane l + lane l + 4, then + 2, + 1
                    sums[r][j] = reduce8(acc[r][j]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "x86_64")]
    use crate::quant::int8_forms::assert_every_form_matches;
    use crate::quant::tests::random_input;
    use crate::quant::TileInput;

    /// Random Q8_0 blocks: scales in (0, 0.02], values over all of -128..=127.
    fn random_matrix(rows: usize, cols: usize, seed: u64) -> Q8_0Matrix {
        let mut state = seed | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut bytes = Vec::with_capacity(rows * cols / QK * BLOCK_BYTES);
        for _ in 0..rows * cols / QK {
            let d = f16::from_f32(0.02 * ((next() >> 40) as f32 / (1u64 << 24) as f32) + 1e-3);
            bytes.extend(d.to_le_bytes());
            bytes.extend((0..32).map(|_| next() as u8));
        }
        Q8_0Matrix::new(rows, cols, bytes).unwrap()
    }

    #[test]
    fn matmul_matches_the_dequantized_dot() {
        for (rows, cols) in [(37, 96), (1, 32), (67, 576)] {
            let w = random_matrix(rows, cols, 31 + rows as u64);
            let wf = w.dequantize_rows(&(0..rows as u32).collect::<Vec<_>>());
            for m in [1, 2, 5, 16] {
                let x = random_input(m, cols, 37 + m as u64);
                let xq = Q8Rows::quantize(&x, cols);
                let xf: Vec<f64> = xq
                    .view()
                    .qs
                    .iter()
                    .enumerate()
                    .map(|(i, &q)| f64::from(q) * f64::from(xq.view().d[i / QK]))
                    .collect();
                for isa in Isa::runnable() {
                    let got = w.matmul_q8_on(isa, &xq);
                    for r in 0..m {
                        for o in 0..rows {
                            let want: f64 = (0..cols)
                                .map(|c| f64::from(wf[o * cols + c]) * xf[r * cols + c])
                                .sum();
                            let g = f64::from(got[r * rows + o]);
                            let err = (g - want).abs() / want.abs().max(1.0);
                            assert!(
                                err < 1e-4,
                                "{isa:?} [{rows}, {cols}] m={m} {r},{o}: {g} vs {want}"
                            );
                        }
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
        let w = random_matrix(4, cols, 59);
        let x = random_input(4, cols, 61);
        let xq = Q8Rows::quantize(&x, cols);
        let rows4 = [w.row(0), w.row(1), w.row(2), w.row(3)];
        fn check<const NR: usize, const M: usize>(rows: [&[u8]; NR], xt: Q8View<'_>) -> usize {
            assert_every_form_matches::<avx2::Q8_0Tile, NR, M>(rows, xt, portable::tile::<NR, M>)
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
        let runnable: Vec<Isa> = Isa::runnable()
            .into_iter()
            .filter(|&i| i != Isa::Portable || crate::quant::portable::HARDWARE_FMA)
            .collect();
        for (rows, cols) in [(11, 160), (75, 576), (4, 32)] {
            let w = random_matrix(rows, cols, 41 + rows as u64);
            let x = random_input(13, cols, 43);
            let xq = Q8Rows::quantize(&x, cols);
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
                    let got = w.matmul_q8_on(isa, &Q8Rows::quantize(&x[..m * cols], cols));
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

    #[test]
    fn extreme_weights_do_not_saturate() {
        // -128 and 127 weights against ±127 activations: the sign trick's worst case
        let mut bytes = f16::from_f32(1.0).to_le_bytes().to_vec();
        bytes.extend((0..32).map(|i| if i % 2 == 0 { 0x80u8 } else { 127 }));
        let w = Q8_0Matrix::new(1, 32, bytes).unwrap();
        let x: Vec<f32> = (0..32)
            .map(|i| if i % 2 == 0 { -1.0 } else { 1.0 })
            .collect();
        let xq = Q8Rows::quantize(&x, 32);
        for isa in Isa::runnable() {
            let got = w.matmul_q8_on(isa, &xq)[0];
            // each lane: 2 · 128 · 127 + 2 · 127 · 127 = 64770, times d_a = 1 / 127; 8 lanes
            assert_eq!(got, 8.0 * (64770.0f32 * (1.0f32 / 127.0)), "{isa:?}");
        }
    }
}
