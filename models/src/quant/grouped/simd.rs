//! The grouped layout (module docs of `super`) multiplied without AMX: AVX-512 and AVX2
//! kernels whose register lanes are the group's weight rows, so one broadcast of four
//! activation bytes meets 16 (or 8) rows in one instruction, and portable code.
//!
//! - AVX-512: a lane per row of the group. Per block, the 256 nibble bytes become 8 registers
//!   (low nibbles: values `4j..4j+4` of each row in register `j < 4`; high nibbles: `16 + 4j..`
//!   in register `4 + j`); for each input row, 8 integer dot products with that row's
//!   activation bytes `4j..4j+4` broadcast give the block's 16 exact sums `s_b`; the epilogue
//!   is the AMX kernel's (`fma(s_b, dw·da, acc)`, then `fma(mw, sa, acc)`). Q8_0's signed
//!   weights take the sign of each weight onto the activation byte (`|w|·(sign(w)·a) = w·a`;
//!   activations are never -128: `Q8Rows` quantizes to -127..=127).
//! - AVX2: the same per half group (8 rows: bytes `32h..32h + 32` of each 64-byte chunk).
//! - Integer sums: AVX512-VNNI / AVX-VNNI `vpdpbusd` where the CPU has it
//!   (`crate::cpu::vnni_for`), else `vpmaddubsw` then `vpmaddwd` by ones (Q4_1 adds the eight
//!   16-bit pair sums of a block first: each is at most 2·15·128, eight of them fit 16 bits).
//! - Invariant: the sums are exact integers and the float operations are the reference's in
//!   the reference's order, so every variant and form equals
//!   [`super::GroupedMatrix::matmul_reference`] bit for bit, and a row's outputs do not depend on
//!   the other rows of its batch (tested per variant, form and batch shape).

use super::super::q8_rows::Q8View;
use super::super::OutPtr;
use super::{GroupedMatrix, TileFormat, GROUP_ROWS};
use crate::cpu::Isa;

/// How a kernel forms its four-product integer sums: `vpmaddubsw` + `vpmaddwd` (AVX2 and
/// AVX-512 without VNNI), AVX-VNNI's `vpdpbusd` (VEX), AVX512-VNNI's `vpdpbusd` (EVEX).
#[cfg(target_arch = "x86_64")]
const PAIR: u8 = 0;
#[cfg(target_arch = "x86_64")]
const VEX: u8 = 1;
#[cfg(target_arch = "x86_64")]
const EVEX: u8 = 2;

/// The outputs of groups `range` for all `m` input rows, with the variant for `isa` (portable
/// code where the CPU has no vector variant).
///
/// # Safety
/// The CPU runs `isa`; `out` holds `m * w.rows` f32 of which nobody else touches these
/// groups' columns while this runs.
pub(super) unsafe fn groups<F: TileFormat>(
    isa: Isa,
    w: &GroupedMatrix<F>,
    x: Q8View<'_>,
    m: usize,
    range: std::ops::Range<usize>,
    out: &OutPtr,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => {
            use crate::cpu::{vnni_for, Vnni};
            // SAFETY: the caller's contract; each form is entered only where `vnni_for` says
            // the CPU has its instructions.
            unsafe {
                match (isa, vnni_for(isa)) {
                    (Isa::Avx512, Vnni::Evex) => x86::avx512_vnni(w, x, m, range, out),
                    (Isa::Avx512, _) => x86::avx512_pair(w, x, m, range, out),
                    (_, Vnni::Vex) => x86::avx2_vnni(w, x, m, range, out),
                    _ => x86::avx2_pair(w, x, m, range, out),
                }
            }
        }
        _ => {
            for g in range {
                // SAFETY: the caller's contract.
                unsafe { portable_group(w, x, m, g, out) }
            }
        }
    }
}

/// Group `g` by the reference arithmetic.
///
/// # Safety
/// As [`groups`].
unsafe fn portable_group<F: TileFormat>(
    w: &GroupedMatrix<F>,
    x: Q8View<'_>,
    m: usize,
    g: usize,
    out: &OutPtr,
) {
    let n = w.rows();
    for r in g * GROUP_ROWS..((g + 1) * GROUP_ROWS).min(n) {
        for (t, y) in w.reference_column(x, m, r).into_iter().enumerate() {
            // SAFETY: row t < m, column r of this group: inside `out`, ours alone.
            unsafe { *out.0.add(t * n + r) = y };
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(in crate::quant) mod x86 {
    use std::arch::x86_64::*;

    use super::{GroupedMatrix, OutPtr, Q8View, TileFormat, GROUP_ROWS};
    use super::{EVEX, PAIR, VEX};
    use crate::quant::QK;

    /// Input rows per pass over a group's blocks with 512-bit registers (their accumulators
    /// stay in registers).
    const PASS_512: usize = 8;
    /// The same with 256-bit registers (16 of them).
    const PASS_256: usize = 4;

    /// A group block's 16 f16 scales `dw` and (0 without) minimums `mw`, as f32 lanes.
    ///
    /// # Safety
    /// AVX-512F and F16C; `gb` is a group block.
    #[inline(always)]
    pub(in crate::quant) unsafe fn scales_512<F: TileFormat>(gb: &[u8]) -> (__m512, __m512) {
        assert!(gb.len() >= 64);
        // SAFETY: 32 bytes at 0 and at 32 of the block (asserted); the caller's features.
        unsafe {
            (
                _mm512_cvtph_ps(_mm256_loadu_si256(gb.as_ptr().cast())),
                if F::MINIMUMS {
                    _mm512_cvtph_ps(_mm256_loadu_si256(gb.as_ptr().add(32).cast()))
                } else {
                    _mm512_setzero_ps()
                },
            )
        }
    }

    /// One block's step of 16 output chains (module docs of `super::super`):
    /// `acc = fma(s, dw·da, acc)`, then `acc = fma(mw, sa, acc)` with minimums.
    ///
    /// # Safety
    /// AVX-512F and FMA.
    #[inline(always)]
    pub(in crate::quant) unsafe fn advance_512<F: TileFormat>(
        acc: &mut __m512,
        s: __m512i,
        (dw, mw): (__m512, __m512),
        da: f32,
        sa: f32,
    ) {
        // SAFETY: register arithmetic only; the caller's features.
        unsafe {
            let p = _mm512_mul_ps(dw, _mm512_set1_ps(da));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), p, *acc);
            if F::MINIMUMS {
                *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(sa), *acc);
            }
        }
    }

    /// Stores the chains of input rows `t0..` for group `g`'s columns (the rows it has).
    ///
    /// # Safety
    /// AVX-512F; rows `t0..t0 + acc.len()` of `out` (rows of `n`) are inside it, and this
    /// group's columns are the caller's alone.
    #[inline(always)]
    pub(in crate::quant) unsafe fn store_group_512(
        out: &OutPtr,
        n: usize,
        g: usize,
        t0: usize,
        acc: &[__m512],
    ) {
        let r0 = g * GROUP_ROWS;
        let valid = (n - r0).min(GROUP_ROWS);
        let mask: __mmask16 = if valid == GROUP_ROWS {
            !0
        } else {
            (1 << valid) - 1
        };
        for (t, a) in acc.iter().enumerate() {
            // SAFETY: row t0 + t, columns r0..r0 + valid < n: this group's (the caller's
            // contract).
            unsafe { _mm512_mask_storeu_ps(out.0.add((t0 + t) * n + r0), mask, *a) };
        }
    }

    macro_rules! entry {
        ($name:ident, $features:literal, $body:ident, $dot:expr) => {
            /// Every group of `range` (module docs).
            ///
            /// # Safety
            /// The CPU has the enabled features; as [`super::groups`].
            #[target_feature(enable = $features)]
            pub(in crate::quant::grouped) unsafe fn $name<F: TileFormat>(
                w: &GroupedMatrix<F>,
                x: Q8View<'_>,
                m: usize,
                range: std::ops::Range<usize>,
                out: &OutPtr,
            ) {
                // SAFETY: the caller's contract.
                unsafe { $body::<F, { $dot }>(w, x, m, range, out) }
            }
        };
    }
    entry!(
        avx512_vnni,
        "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
        groups_512,
        EVEX
    );
    entry!(
        avx512_pair,
        "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c",
        groups_512,
        PAIR
    );
    entry!(avx2_vnni, "avx2,fma,f16c,avxvnni", groups_256, VEX);
    entry!(avx2_pair, "avx2,fma,f16c", groups_256, PAIR);

    /// Calls `$pass::<F, DOT, nt>` for the `nt` of a pass (1 ..= `$max`).
    macro_rules! by_rows {
        ($nt:expr, $pass:ident, $args:tt, $($n:literal)|*) => {
            match $nt {
                $($n => $pass::<F, DOT, $n> $args,)*
                _ => unreachable!("a pass of {} input rows", $nt),
            }
        };
    }

    #[inline(always)]
    unsafe fn groups_512<F: TileFormat, const DOT: u8>(
        w: &GroupedMatrix<F>,
        x: Q8View<'_>,
        m: usize,
        range: std::ops::Range<usize>,
        out: &OutPtr,
    ) {
        for g in range {
            let mut t0 = 0;
            while t0 < m {
                let nt = (m - t0).min(PASS_512);
                // SAFETY: the caller's contract; rows t0..t0 + nt < m.
                unsafe {
                    by_rows!(
                        nt,
                        pass_512,
                        (w, g, x, t0, out),
                        1 | 2 | 3 | 4 | 5 | 6 | 7 | 8
                    )
                };
                t0 += nt;
            }
        }
    }

    #[inline(always)]
    unsafe fn groups_256<F: TileFormat, const DOT: u8>(
        w: &GroupedMatrix<F>,
        x: Q8View<'_>,
        m: usize,
        range: std::ops::Range<usize>,
        out: &OutPtr,
    ) {
        for g in range {
            for half in 0..2 {
                if g * GROUP_ROWS + 8 * half >= w.rows() {
                    break;
                }
                let mut t0 = 0;
                while t0 < m {
                    let nt = (m - t0).min(PASS_256);
                    // SAFETY: the caller's contract; rows t0..t0 + nt < m.
                    unsafe { by_rows!(nt, pass_256, (w, g, half, x, t0, out), 1 | 2 | 3 | 4) };
                    t0 += nt;
                }
            }
        }
    }

    /// Input rows `t0..t0 + NT` against group `g`, a lane per weight row.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/DQ, FMA, F16C (and AVX512-VNNI for `EVEX`); as [`super::groups`].
    #[inline(always)]
    unsafe fn pass_512<F: TileFormat, const DOT: u8, const NT: usize>(
        w: &GroupedMatrix<F>,
        g: usize,
        x: Q8View<'_>,
        t0: usize,
        out: &OutPtr,
    ) {
        // SAFETY: the caller's contract: the CPU has the features of these intrinsics; the
        // pointers read and written are the ones the comments below name.
        unsafe {
            let (k, n, nb) = (w.cols(), w.rows(), w.blocks());
            let low = _mm512_set1_epi8(0x0F);
            let ones = _mm512_set1_epi16(1);
            let zero = _mm512_setzero_si512();
            let mut acc = [_mm512_setzero_ps(); NT];
            // the pass's activation rows, checked once here rather than per block and row
            let (qs_rows, d_rows, s_rows) = x.row_ptrs(t0..t0 + NT, k, nb);
            for b in 0..nb {
                let gb = w.group_block(g, b);
                let mut wv = [zero; 8];
                let mut negative = [0 as __mmask64; 8];
                // SAFETY: a group block holds the weights at `WEIGHTS_AT`: 256 nibble bytes or
                // 512 signed bytes.
                let wp = gb.as_ptr().add(F::WEIGHTS_AT);
                if F::NIBBLES {
                    for c in 0..4 {
                        let v = _mm512_loadu_si512(wp.add(64 * c).cast());
                        wv[c] = _mm512_and_si512(v, low);
                        wv[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    }
                } else {
                    for (j, (v, neg)) in wv.iter_mut().zip(&mut negative).enumerate() {
                        let s = _mm512_loadu_si512(wp.add(64 * j).cast());
                        *neg = _mm512_movepi8_mask(s);
                        *v = _mm512_abs_epi8(s);
                    }
                }
                let scales = scales_512::<F>(gb);
                for (t, a) in acc.iter_mut().enumerate() {
                    // SAFETY: row t < NT of the pass, block b < nb: inside the slices above.
                    let (xq, xd, xs) = (
                        qs_rows.add(t * k + b * QK).cast::<i32>(),
                        *d_rows.add(t * nb + b),
                        *s_rows.add(t * nb + b),
                    );
                    let mut s = zero;
                    for j in 0..8 {
                        // SAFETY: dword j of the block's 32 activation bytes.
                        let mut xa = _mm512_set1_epi32(xq.add(j).read_unaligned());
                        if !F::NIBBLES {
                            xa = _mm512_mask_sub_epi8(xa, negative[j], zero, xa);
                        }
                        s = match DOT {
                            EVEX => _mm512_dpbusd_epi32(s, wv[j], xa),
                            // Q4_1: 16-bit pair sums, added up before one widening below
                            _ if F::NIBBLES => _mm512_add_epi16(s, _mm512_maddubs_epi16(wv[j], xa)),
                            _ => _mm512_add_epi32(
                                s,
                                _mm512_madd_epi16(_mm512_maddubs_epi16(wv[j], xa), ones),
                            ),
                        };
                    }
                    if DOT != EVEX && F::NIBBLES {
                        s = _mm512_madd_epi16(s, ones);
                    }
                    advance_512::<F>(a, s, scales, xd, xs);
                }
            }
            // rows t0..t0 + NT < m: inside `out`
            store_group_512(out, n, g, t0, &acc);
        }
    }

    /// Input rows `t0..t0 + NT` against half `half` of group `g` (rows `8 * half..`), a lane
    /// per weight row.
    ///
    /// # Safety
    /// AVX2, FMA, F16C (and AVX-VNNI for `VEX`); as [`super::groups`].
    #[inline(always)]
    unsafe fn pass_256<F: TileFormat, const DOT: u8, const NT: usize>(
        w: &GroupedMatrix<F>,
        g: usize,
        half: usize,
        x: Q8View<'_>,
        t0: usize,
        out: &OutPtr,
    ) {
        // SAFETY: the caller's contract: the CPU has the features of these intrinsics; the
        // pointers read and written are the ones the comments below name.
        unsafe {
            let (k, n, nb) = (w.cols(), w.rows(), w.blocks());
            let low = _mm256_set1_epi8(0x0F);
            let ones = _mm256_set1_epi16(1);
            let zero = _mm256_setzero_si256();
            let mut acc = [_mm256_setzero_ps(); NT];
            // the pass's activation rows, checked once here rather than per block and row
            let (qs_rows, d_rows, s_rows) = x.row_ptrs(t0..t0 + NT, k, nb);
            for b in 0..nb {
                let gb = w.group_block(g, b);
                let mut wv = [zero; 8];
                let mut signs = [zero; 8];
                // SAFETY: as in `pass_512`; this half's 32 bytes of each 64-byte chunk, its 8
                // scales at 16 * half and minimums at 32 + 16 * half.
                let (dw, mw) = {
                    let wp = gb.as_ptr().add(F::WEIGHTS_AT + 32 * half);
                    if F::NIBBLES {
                        for c in 0..4 {
                            let v = _mm256_loadu_si256(wp.add(64 * c).cast());
                            wv[c] = _mm256_and_si256(v, low);
                            wv[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                        }
                    } else {
                        for (j, (v, sign)) in wv.iter_mut().zip(&mut signs).enumerate() {
                            *sign = _mm256_loadu_si256(wp.add(64 * j).cast());
                            *v = _mm256_abs_epi8(*sign);
                        }
                    }
                    (
                        _mm256_cvtph_ps(_mm_loadu_si128(gb.as_ptr().add(16 * half).cast())),
                        if F::MINIMUMS {
                            _mm256_cvtph_ps(_mm_loadu_si128(gb.as_ptr().add(32 + 16 * half).cast()))
                        } else {
                            _mm256_setzero_ps()
                        },
                    )
                };
                for (t, a) in acc.iter_mut().enumerate() {
                    // SAFETY: row t < NT of the pass, block b < nb: inside the slices above.
                    let (xq, xd, xs) = (
                        qs_rows.add(t * k + b * QK).cast::<i32>(),
                        *d_rows.add(t * nb + b),
                        *s_rows.add(t * nb + b),
                    );
                    let mut s = zero;
                    for j in 0..8 {
                        // SAFETY: dword j of the block's 32 activation bytes.
                        let mut xa = _mm256_set1_epi32(xq.add(j).read_unaligned());
                        if !F::NIBBLES {
                            xa = _mm256_sign_epi8(xa, signs[j]);
                        }
                        s = match DOT {
                            VEX => _mm256_dpbusd_avx_epi32(s, wv[j], xa),
                            _ if F::NIBBLES => _mm256_add_epi16(s, _mm256_maddubs_epi16(wv[j], xa)),
                            _ => _mm256_add_epi32(
                                s,
                                _mm256_madd_epi16(_mm256_maddubs_epi16(wv[j], xa), ones),
                            ),
                        };
                    }
                    if DOT != VEX && F::NIBBLES {
                        s = _mm256_madd_epi16(s, ones);
                    }
                    let p = _mm256_mul_ps(dw, _mm256_set1_ps(xd));
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), p, *a);
                    if F::MINIMUMS {
                        *a = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs), *a);
                    }
                }
            }
            let r0 = g * GROUP_ROWS + 8 * half;
            let valid = (n - r0).min(8);
            for (t, a) in acc.iter().enumerate() {
                let mut lanes = [0f32; 8];
                // SAFETY: 8 f32 into a local array.
                _mm256_storeu_ps(lanes.as_mut_ptr(), *a);
                for (i, &v) in lanes[..valid].iter().enumerate() {
                    // SAFETY: row t0 + t < m, column r0 + i < n: this group's, inside `out`.
                    *out.0.add((t0 + t) * n + r0 + i) = v;
                }
            }
        }
    }
}
