//! The x86 forms of the kernels with 8-bit activations (Q4_1 in `int8`, Q8_0 in `q8_0`) and
//! the run-time choice between them: one kernel's tile is written once, generic over how the
//! four-product integer sums are formed, and this module compiles it for each form and picks
//! one per call.
//!
//! - Forms: `PAIR` (`vpmaddubsw` + `vpmaddwd`, AVX2), `VEX` (AVX-VNNI `vpdpbusd`) and `EVEX`
//!   (AVX512-VNNI `vpdpbusd`), chosen by [`crate::cpu::vnni_for`]; a kernel may add a 512-bit
//!   form that pairs weight rows for batches ([`IntTile::PAIRS_IN_512`]).
//! - Invariant: every form computes each lane with the same exact integer sums and the same
//!   float operations in the same order, so all forms give the same bits (tested per kernel
//!   with [`assert_every_form_matches`]).

use std::marker::PhantomData;

use super::int8::Q8View;
use super::{TileKernel, MT};
use crate::cpu::{vnni_for, Isa, Vnni};

/// How a tile forms its four-product integer sums.
pub(super) const PAIR: u8 = 0;
pub(super) const VEX: u8 = 1;
pub(super) const EVEX: u8 = 2;

/// One kernel's tile, generic over the form of its integer sums.
pub(super) trait IntTile {
    /// Whether [`IntTile::tile_512`] pairs weight rows in 512-bit registers (batches only).
    const PAIRS_IN_512: bool = false;

    /// The 256-bit tile, sums formed as `DOT` says.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C, and AVX-VNNI for `VEX`, AVX512-VNNI (with VL) for
    /// `EVEX`.
    unsafe fn tile<const NR: usize, const M: usize, const DOT: u8>(
        rows: [&[u8]; NR],
        xt: Q8View<'_>,
        sums: &mut [[f32; 4]; MT],
    );

    /// The 512-bit tile for `NR` 2 or 4 (`PAIR` or `EVEX`); the 256-bit one unless
    /// [`IntTile::PAIRS_IN_512`].
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C, and AVX512-VNNI for `EVEX`.
    #[inline(always)]
    unsafe fn tile_512<const NR: usize, const M: usize, const DOT: u8>(
        rows: [&[u8]; NR],
        xt: Q8View<'_>,
        sums: &mut [[f32; 4]; MT],
    ) {
        // SAFETY: the caller's contract covers the 256-bit tile's.
        unsafe { Self::tile::<NR, M, DOT>(rows, xt, sums) }
    }
}

/// The AVX2 variant of the kernel `T`: AVX-VNNI where the CPU has it.
pub(super) struct Avx2<T>(PhantomData<T>);
/// The AVX-512 variant of the kernel `T`: AVX512-VNNI where the CPU has it, and the 512-bit
/// tile for batches where `T` has one.
pub(super) struct Avx512<T>(PhantomData<T>);

impl<T: IntTile> TileKernel<Q8View<'_>> for Avx2<T> {
    const INPUT_ROWS: usize = 4;

    #[inline(always)]
    fn weight_rows(mt: usize, left: usize) -> usize {
        super::int8::weight_rows(mt, left)
    }

    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[inline(always)]
    unsafe fn tile<const NR: usize, const M: usize>(
        rows: [&[u8]; NR],
        xt: Q8View<'_>,
        sums: &mut [[f32; 4]; MT],
    ) {
        // SAFETY: the caller's contract; `vnni_for` answers `Vex` only on a CPU with AVX-VNNI.
        unsafe {
            match vnni_for(Isa::Avx2) {
                Vnni::Vex => avxvnni::<T, NR, M>(rows, xt, sums),
                _ => T::tile::<NR, M, PAIR>(rows, xt, sums),
            }
        }
    }
}

impl<T: IntTile> TileKernel<Q8View<'_>> for Avx512<T> {
    const INPUT_ROWS: usize = 4;

    /// With rows paired in 512-bit registers, four weight rows for any batch (8 accumulators
    /// at most); otherwise the 256-bit tile's shape.
    #[inline(always)]
    fn weight_rows(mt: usize, left: usize) -> usize {
        if !T::PAIRS_IN_512 {
            return super::int8::weight_rows(mt, left);
        }
        match left {
            1 => 1,
            2 | 3 => 2,
            _ => 4,
        }
    }

    /// # Safety
    /// The CPU has AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C.
    #[inline(always)]
    unsafe fn tile<const NR: usize, const M: usize>(
        rows: [&[u8]; NR],
        xt: Q8View<'_>,
        sums: &mut [[f32; 4]; MT],
    ) {
        // one input row keeps the 256-bit tile: pairing rows costs more than it saves when
        // each weight block meets one input block (measured)
        let paired = T::PAIRS_IN_512 && NR > 1 && M > 1;
        // SAFETY: the caller's contract; `vnni_for` answers `Evex` only on a CPU with
        // AVX512-VNNI.
        unsafe {
            match (paired, vnni_for(Isa::Avx512)) {
                (false, Vnni::Evex) => avx512vnni::<T, NR, M>(rows, xt, sums),
                (false, _) => T::tile::<NR, M, PAIR>(rows, xt, sums),
                (true, Vnni::Evex) => avx512vnni_512::<T, NR, M>(rows, xt, sums),
                (true, _) => T::tile_512::<NR, M, PAIR>(rows, xt, sums),
            }
        }
    }
}

/// # Safety
/// The CPU has AVX2, FMA, F16C and AVX-VNNI.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn avxvnni<T: IntTile, const NR: usize, const M: usize>(
    rows: [&[u8]; NR],
    xt: Q8View<'_>,
    sums: &mut [[f32; 4]; MT],
) {
    // SAFETY: the caller's contract.
    unsafe { T::tile::<NR, M, VEX>(rows, xt, sums) }
}

/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ and VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn avx512vnni<T: IntTile, const NR: usize, const M: usize>(
    rows: [&[u8]; NR],
    xt: Q8View<'_>,
    sums: &mut [[f32; 4]; MT],
) {
    // SAFETY: the caller's contract.
    unsafe { T::tile::<NR, M, EVEX>(rows, xt, sums) }
}

/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ and VNNI, AVX2, FMA and F16C; `NR` is 2 or 4.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn avx512vnni_512<T: IntTile, const NR: usize, const M: usize>(
    rows: [&[u8]; NR],
    xt: Q8View<'_>,
    sums: &mut [[f32; 4]; MT],
) {
    // SAFETY: the caller's contract.
    unsafe { T::tile_512::<NR, M, EVEX>(rows, xt, sums) }
}

/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[cfg(test)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair<T: IntTile, const NR: usize, const M: usize>(
    rows: [&[u8]; NR],
    xt: Q8View<'_>,
    sums: &mut [[f32; 4]; MT],
) {
    // SAFETY: the caller's contract.
    unsafe { T::tile::<NR, M, PAIR>(rows, xt, sums) }
}

/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C; `NR` is 2 or 4.
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn pair_512<T: IntTile, const NR: usize, const M: usize>(
    rows: [&[u8]; NR],
    xt: Q8View<'_>,
    sums: &mut [[f32; 4]; MT],
) {
    // SAFETY: the caller's contract.
    unsafe { T::tile_512::<NR, M, PAIR>(rows, xt, sums) }
}

/// One form of a tile, as the tests call each.
#[cfg(test)]
type TileFn<const NR: usize> =
    for<'w, 'x> unsafe fn([&'w [u8]; NR], Q8View<'x>, &mut [[f32; 4]; MT]);

/// A portable tile, the reference the forms are checked against.
#[cfg(test)]
type ReferenceFn<const NR: usize> = for<'w, 'x> fn([&'w [u8]; NR], Q8View<'x>, &mut [[f32; 4]; MT]);

/// Asserts that every form of `T`'s tile this CPU runs gives `reference`'s bits for the tile
/// `rows` x `xt`; returns how many forms ran.
#[cfg(test)]
pub(super) fn assert_every_form_matches<T: IntTile, const NR: usize, const M: usize>(
    rows: [&[u8]; NR],
    xt: Q8View<'_>,
    reference: ReferenceFn<NR>,
) -> usize {
    let mut want = [[0f32; 4]; MT];
    reference(rows, xt, &mut want);
    let avx512 = Isa::Avx512.supported();
    let has_avx512vnni = avx512 && is_x86_feature_detected!("avx512vnni");
    let paired = T::PAIRS_IN_512 && NR.is_multiple_of(2);
    let forms: [(&str, bool, TileFn<NR>); 5] = [
        ("pair", Isa::Avx2.supported(), pair::<T, NR, M>),
        (
            "avxvnni",
            is_x86_feature_detected!("avxvnni"),
            avxvnni::<T, NR, M>,
        ),
        ("avx512vnni", has_avx512vnni, avx512vnni::<T, NR, M>),
        ("512-bit pair", paired && avx512, pair_512::<T, NR, M>),
        (
            "512-bit avx512vnni",
            paired && has_avx512vnni,
            avx512vnni_512::<T, NR, M>,
        ),
    ];
    let mut ran = 0;
    for (name, runs, form) in forms {
        if !runs {
            continue;
        }
        let mut got = [[0f32; 4]; MT];
        // SAFETY: each form runs only where the CPU has its instructions (`runs`).
        unsafe { form(rows, xt, &mut got) };
        for r in 0..M {
            for j in 0..NR {
                assert_eq!(
                    got[r][j].to_bits(),
                    want[r][j].to_bits(),
                    "{name} NR={NR} M={M} ({r}, {j})"
                );
            }
        }
        ran += 1;
    }
    ran
}
