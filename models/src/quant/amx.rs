//! The grouped matrices' matmul on AMX tiles: 8-bit activations ([`Q8Rows`]) times the
//! file's 4- or 8-bit weights by `tdpbssd`, 16 weight rows by up to 16 input rows by one
//! 32-value block per instruction, where the CPU has AMX-INT8 and Linux grants its tile state.
//!
//! - Q8_0 blocks are a B tile as stored (`super::grouped`'s layout), loaded straight from the
//!   matrix; Q4_1's nibbles are unpacked into B tiles, one per block, per group: masking the
//!   low nibbles of the 256 bytes gives tile rows 0..4 (values 0..16), shifting out the high
//!   ones rows 4..8 (values 16..32), two instructions per 64 bytes.
//! - Arithmetic: the grouped layout's (its module docs): the tile sums `s_b` per block, then
//!   each output's chain in one lane of an AVX-512 register (lanes are 16 weight rows of one
//!   input row), so it equals [`GroupedMatrix::matmul_reference`] bit for bit and a row's
//!   result does not depend on the other rows of its batch.
//! - Availability ([`amx_available`]): AMX-TILE and AMX-INT8 in CPUID, AVX-512 (the epilogue)
//!   in the variant [`Isa::active`] picks, and Linux's `ARCH_REQ_XCOMP_PERM` for the tile data
//!   granted, asked once per process. The kernel is entered only then; elsewhere the grouped
//!   matrices run their vector kernels, and `--dtype native-amx` is refused at load.
//! - Threads: each work item loads its tile configuration, and releases the tiles before it
//!   returns.

use std::sync::OnceLock;

use super::grouped::{GroupedMatrix, TileFormat};
#[cfg(target_arch = "x86_64")]
use super::q8_rows::Q8View;
#[cfg(target_arch = "x86_64")]
use super::OutPtr;
use crate::cpu::Isa;
#[cfg(doc)]
use crate::quant::Q8Rows;

/// Input rows per tile: the 16 rows of an A tile.
#[cfg(target_arch = "x86_64")]
const TILE_INPUTS: usize = 16;

/// Whether the AMX kernel may run in this process (module docs): asked once.
pub fn amx_available() -> bool {
    static HARDWARE: OnceLock<bool> = OnceLock::new();
    *HARDWARE.get_or_init(detect) && Isa::active() == Isa::Avx512
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    if !Isa::Avx512.supported() {
        return false;
    }
    // CPUID.(EAX=7, ECX=0):EDX bit 24 is AMX-TILE, bit 25 AMX-INT8.
    let leaf = std::arch::x86_64::__cpuid_count(7, 0);
    if leaf.edx & (3 << 24) != 3 << 24 {
        return false;
    }
    // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): Linux enables the 8 KiB tile state
    // for this process's threads only when asked; 0 is granted.
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a system call with integer arguments that touches no memory of ours.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// Groups `range` of a grouped matrix on AMX tiles, all `m` input rows (`kernel::groups`).
#[cfg(target_arch = "x86_64")]
pub(super) use kernel::groups as amx_groups;

#[cfg(target_arch = "x86_64")]
mod kernel {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::super::grouped::simd::x86::{advance_512, scales_512, store_group_512};
    use super::super::grouped::{B_TILE_BYTES, GROUP_ROWS};
    use super::super::QK;
    use super::{GroupedMatrix, OutPtr, Q8View, TileFormat, TILE_INPUTS};

    /// The 64-byte operand of `ldtilecfg` (palette 1).
    #[repr(C, align(64))]
    struct TileConfig {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        colsb: [u16; 16],
        rows: [u8; 16],
        reserved2: [u8; 16],
    }

    /// Loads the tiles for `nt` input rows: tmm0 = A (nt rows of a block's 32 activations),
    /// tmm1 = B (the block's 8 x 64 weight bytes), tmm2 = C (nt rows of 16 i32).
    ///
    /// # Safety
    /// AMX is available and granted.
    unsafe fn configure(nt: usize) {
        let mut cfg = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
            reserved2: [0; 16],
        };
        cfg.rows[0] = nt as u8;
        cfg.colsb[0] = QK as u16;
        cfg.rows[1] = 8;
        cfg.colsb[1] = 64;
        cfg.rows[2] = nt as u8;
        cfg.colsb[2] = 64;
        // SAFETY: a valid palette-1 configuration (rows <= 16, bytes per row <= 64).
        unsafe { asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileConfig, options(nostack)) };
    }

    /// Every group of `range`: its output columns for all `m` rows.
    ///
    /// # Safety
    /// AMX is available and granted; `out` holds `m * w.rows` f32 of which nobody else touches
    /// these groups' columns while this runs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(in crate::quant) unsafe fn groups<F: TileFormat>(
        w: &GroupedMatrix<F>,
        x: Q8View<'_>,
        m: usize,
        range: std::ops::Range<usize>,
        out: &OutPtr,
    ) {
        let nb = w.blocks();
        let mut unpacked = vec![0u8; if F::NIBBLES { nb * B_TILE_BYTES } else { 0 }];
        let mut configured = 0;
        for g in range {
            if F::NIBBLES {
                unpack_group(w, g, &mut unpacked);
            }
            let mut t0 = 0;
            while t0 < m {
                let nt = (m - t0).min(TILE_INPUTS);
                if nt != configured {
                    // SAFETY: the caller's contract.
                    unsafe { configure(nt) };
                    configured = nt;
                }
                macro_rules! go {
                    ($($n:literal)|*) => {
                        match nt {
                            // SAFETY: tiles configured for `nt`; the caller's contract.
                            $($n => unsafe { tile::<F, $n>(w, g, &unpacked, x, t0, out) },)*
                            _ => unreachable!("tile of {nt} rows"),
                        }
                    };
                }
                go!(1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9 | 10 | 11 | 12 | 13 | 14 | 15 | 16);
                t0 += nt;
            }
        }
        if configured != 0 {
            // SAFETY: returns the tile state configured above.
            unsafe { asm!("tilerelease", options(nostack, nomem)) };
        }
    }

    /// Group `g`'s B tiles, one per block: low nibbles are tile rows 0..4, high nibbles 4..8.
    #[target_feature(enable = "avx512f,avx512bw")]
    fn unpack_group<F: TileFormat>(w: &GroupedMatrix<F>, g: usize, unpacked: &mut [u8]) {
        let low = _mm512_set1_epi8(0x0F);
        for (b, tile) in unpacked.chunks_exact_mut(B_TILE_BYTES).enumerate() {
            let nibbles = &w.group_block(g, b)[F::WEIGHTS_AT..];
            for c in 0..4 {
                // SAFETY: 64 bytes at 64 * c of the 256 nibble bytes, and of the tile's two
                // 256-byte halves.
                unsafe {
                    let v = _mm512_loadu_si512(nibbles.as_ptr().add(64 * c).cast());
                    let lo = _mm512_and_si512(v, low);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    _mm512_storeu_si512(tile.as_mut_ptr().add(64 * c).cast(), lo);
                    _mm512_storeu_si512(tile.as_mut_ptr().add(256 + 64 * c).cast(), hi);
                }
            }
        }
    }

    /// Input rows `t0..t0 + NT` against group `g`: one `tdpbssd` per block, then each row's 16
    /// outputs advance their chains in the lanes of one register (module docs).
    ///
    /// # Safety
    /// Tiles configured for `NT` rows; as [`groups`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn tile<F: TileFormat, const NT: usize>(
        w: &GroupedMatrix<F>,
        g: usize,
        unpacked: &[u8],
        x: Q8View<'_>,
        t0: usize,
        out: &OutPtr,
    ) {
        #[repr(C, align(64))]
        struct Sums([[i32; GROUP_ROWS]; TILE_INPUTS]);
        let (k, n, nb) = (w.cols(), w.rows(), w.blocks());
        let mut sums = Sums([[0; GROUP_ROWS]; TILE_INPUTS]);
        let mut acc = [_mm512_setzero_ps(); NT];
        let a_base = x.qs[t0 * k..(t0 + NT) * k].as_ptr();
        for b in 0..nb {
            let gb = w.group_block(g, b);
            let b_tile = if F::NIBBLES {
                &unpacked[b * B_TILE_BYTES..][..B_TILE_BYTES]
            } else {
                &gb[F::WEIGHTS_AT..][..B_TILE_BYTES]
            };
            // SAFETY: A reads NT rows of 32 bytes at stride k from block b of rows t0..t0+NT
            // (inside `x.qs`); B reads the block's 512 unpacked bytes; C is stored into `sums`
            // (NT rows of 64 bytes).
            unsafe {
                asm!(
                    "tileloadd tmm0, [{a} + {k}*1]",
                    "tileloadd tmm1, [{b} + {sixty_four}*1]",
                    "tilezero tmm2",
                    "tdpbssd tmm2, tmm0, tmm1",
                    "tilestored [{c} + {sixty_four}*1], tmm2",
                    a = in(reg) a_base.add(b * QK),
                    k = in(reg) k,
                    b = in(reg) b_tile.as_ptr(),
                    sixty_four = in(reg) 64usize,
                    c = in(reg) sums.0.as_mut_ptr(),
                    options(nostack),
                );
            }
            // SAFETY: the features enabled here; `gb` is a group block.
            let scales = unsafe { scales_512::<F>(gb) };
            for (t, a) in acc.iter_mut().enumerate() {
                let at = (t0 + t) * nb + b;
                // SAFETY: row t of `sums` is 16 aligned i32; the features enabled here.
                unsafe {
                    let s = _mm512_load_si512(sums.0[t].as_ptr().cast());
                    advance_512::<F>(a, s, scales, x.d[at], x.s[at]);
                }
            }
        }
        // SAFETY: rows t0..t0 + NT < m and this group's columns (the caller's contract).
        unsafe { store_group_512(out, n, g, t0, &acc) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::grouped::tests::{every_byte_q8_0, random_inputs, random_q4_1};
    use super::super::{GroupedQ4_1Matrix, Q8Rows};
    use super::*;

    /// The AMX kernel against the reference for every batch size that makes a new tile shape,
    /// and row 0 alone against row 0 in each batch.
    fn check_amx<F: TileFormat>(w: &GroupedMatrix<F>, all: &[f32], what: &str) {
        let cols = w.cols();
        for m in [1, 3, 16, 17, 40] {
            let x = Q8Rows::quantize(&all[..m * cols], cols);
            let got = w.matmul_q8_with(Isa::Avx512, true, &x);
            let want = w.matmul_reference(&x);
            let bad = got
                .iter()
                .zip(&want)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(bad, None, "{what} at batch {m}: first difference");
            let alone = w.matmul_q8_with(Isa::Avx512, true, &Q8Rows::quantize(&all[..cols], cols));
            assert_eq!(
                alone[..],
                got[..w.rows()],
                "{what}: row 0 alone and in a batch of {m}"
            );
        }
    }

    #[test]
    fn amx_q8_0_equals_the_reference_bit_for_bit_in_any_batch() {
        if !amx_available() {
            eprintln!("AMX not available on this CPU: the AMX kernel is not tested here");
            return;
        }
        for (rows, cols) in [(40, 96), (48, 576)] {
            let w = every_byte_q8_0(rows, cols);
            check_amx(
                &w,
                &random_inputs(40, cols, 7),
                &format!("Q8_0 [{rows}, {cols}]"),
            );
        }
    }

    #[test]
    fn amx_equals_the_reference_bit_for_bit_in_any_batch() {
        if !amx_available() {
            eprintln!("AMX not available on this CPU: the AMX kernel is not tested here");
            return;
        }
        for (rows, cols) in [(40, 96), (576, 576), (48, 1536)] {
            let w = GroupedQ4_1Matrix::new(&random_q4_1(rows, cols, rows as u64));
            let all = random_inputs(40, cols, cols as u64);
            check_amx(&w, &all, &format!("Q4_1 [{rows}, {cols}]"));
        }
    }
}
