//! The Q4_1 and Q8_0 matmuls on AMX tiles (`--dtype native-amx`): 8-bit activations
//! ([`Q8Rows`]) times the file's 4- or 8-bit weights by `tdpbssd`, 16 weight rows by up to 16
//! input rows by one 32-value block per instruction, where the CPU has AMX-INT8 and Linux
//! grants its tile state.
//!
//! - Q8_0 ([`AmxQ8_0Matrix`], SmolLM2's tied embedding / lm_head): per group and block the 16
//!   rows' f16 scales, then the block's B tile as is (byte `kk * 64 + r * 4 + i` is row `r`'s
//!   value `4 * kk + i`), which the kernel loads straight from the matrix; no minimum term.
//! - Q4_1 layout ([`AmxQ4_1Matrix`]): the file's blocks regrouped, same bytes per weight. Rows are
//!   taken 16 at a time (a *group*; the last one padded with zero rows); per group and block:
//!   the 16 rows' f16 scales `d`, their 16 f16 minimums `m`, then the 16 rows' 16 nibble bytes
//!   in the order of an AMX B tile: byte `kk * 64 + r * 4 + i` is row `r`'s file byte
//!   `4 * kk + i` (`kk < 4`), whose low nibble is value `4 * kk + i` of the block and whose high
//!   nibble is value `16 + 4 * kk + i`. Masking the low nibbles of the 256 bytes gives tile rows
//!   0..4 (values 0..16), shifting out the high ones gives rows 4..8 (values 16..32): the B tile
//!   of the block (8 rows of 64 bytes, four consecutive values per weight row) in two
//!   instructions per 64 bytes.
//! - Arithmetic, per output `y[t][r]`: `acc = 0`; for every block `b` in order,
//!   `acc = fma(s_b, dw·da, acc)` then `acc = fma(mw, sa, acc)`, with `s_b = Σ_i qw_i·qa_i`
//!   exact in 32-bit integers (what `tdpbssd` sums for the block), `dw·da` rounded to f32, `sa`
//!   the activation block's `d·Σq`. The AMX kernel runs each output's chain in one lane of an
//!   AVX-512 register (lanes are 16 weight rows of one input row), so it equals
//!   [`AmxQ4_1Matrix::matmul_reference`] bit for bit and a row's result does not depend on the
//!   other rows of its batch. (The `native-i8` kernels sum each block in 8 lanes first: the
//!   same exact integers, another order of the f32 sums, so the two modes differ in the last
//!   bits.)
//! - Availability ([`amx_available`]): AMX-TILE and AMX-INT8 in CPUID, AVX-512 (the epilogue)
//!   in the variant [`Isa::active`] picks, and Linux's `ARCH_REQ_XCOMP_PERM` for the tile data
//!   granted, asked once per process. The kernel is entered only then; elsewhere the mode is
//!   refused at load (`WeightMode::NativeAmx`).
//! - Threads: groups are split over candle's pool as the other kernels' row groups are; each
//!   work item loads its tile configuration, and releases the tiles before it returns.

use std::sync::OnceLock;

use super::int8::Q8View;
use super::{OutPtr, Q4_1Matrix, Q8_0Matrix, BLOCK_BYTES, QK};
use crate::cpu::Isa;
use crate::quant::Q8Rows;

/// Weight rows per group: the 16 columns of a `tdpbssd` result.
pub(super) const GROUP_ROWS: usize = 16;
/// Input rows per tile: the 16 rows of an A tile.
const TILE_INPUTS: usize = 16;
/// Bytes of a block's B tile: 8 rows of 64 signed bytes (4 consecutive values of 16 rows each).
const B_TILE_BYTES: usize = 512;

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

/// How a quantized type's blocks sit in an [`AmxMatrix`]: per group of 16 rows and block, the
/// rows' f16 scales `d` (bytes 0..32), their f16 minimums `m` if the type has them (32..64),
/// then the block's weights in B-tile order (module docs).
pub trait TileFormat: Send + Sync + 'static {
    /// Bytes per group and block.
    const GROUP_BLOCK_BYTES: usize;
    /// Whether a value is `d·q + m` (else `d·q`).
    const MINIMUMS: bool;
    /// Where the weights start in a group block.
    const WEIGHTS_AT: usize;
    /// Whether the weights are 256 nibble bytes to unpack into the B tile (else they are it).
    const NIBBLES: bool;
}

/// Q4_1: scales, minimums, 256 nibble bytes.
#[derive(Debug, Clone, Copy)]
pub struct Q4_1Tiles;
impl TileFormat for Q4_1Tiles {
    const GROUP_BLOCK_BYTES: usize = 32 + 32 + 256;
    const MINIMUMS: bool = true;
    const WEIGHTS_AT: usize = 64;
    const NIBBLES: bool = true;
}

/// Q8_0: scales, then the 512-byte B tile of signed values.
#[derive(Debug, Clone, Copy)]
pub struct Q8_0Tiles;
impl TileFormat for Q8_0Tiles {
    const GROUP_BLOCK_BYTES: usize = 32 + B_TILE_BYTES;
    const MINIMUMS: bool = false;
    const WEIGHTS_AT: usize = 32;
    const NIBBLES: bool = false;
}

/// A `[rows, cols]` quantized matrix regrouped for AMX tiles (module docs).
#[derive(Debug, Clone)]
pub struct AmxMatrix<F> {
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
    format: std::marker::PhantomData<F>,
}

/// Q4_1 regrouped for AMX (`--dtype native-amx`'s layer matrices).
pub type AmxQ4_1Matrix = AmxMatrix<Q4_1Tiles>;
/// Q8_0 regrouped for AMX (`--dtype native-amx`'s tied embedding / lm_head).
pub type AmxQ8_0Matrix = AmxMatrix<Q8_0Tiles>;

impl AmxMatrix<Q4_1Tiles> {
    /// Regroups `w` (any CPU can hold the form; only [`amx_available`] ones multiply with AMX).
    pub fn new(w: &Q4_1Matrix) -> AmxQ4_1Matrix {
        AmxMatrix::regroup(w.rows, w.cols, &w.bytes, BLOCK_BYTES, |blk, gb, lr| {
            gb[2 * lr..2 * lr + 2].copy_from_slice(&blk[0..2]);
            gb[32 + 2 * lr..32 + 2 * lr + 2].copy_from_slice(&blk[2..4]);
            for j in 0..16 {
                gb[64 + (j / 4) * 64 + lr * 4 + j % 4] = blk[4 + j];
            }
        })
    }
}

impl AmxMatrix<Q8_0Tiles> {
    /// Regroups `w` (as [`AmxQ4_1Matrix::new`]).
    pub fn new(w: &Q8_0Matrix) -> AmxQ8_0Matrix {
        let (rows, cols, bytes) = w.parts();
        AmxMatrix::regroup(rows, cols, bytes, 34, |blk, gb, lr| {
            gb[2 * lr..2 * lr + 2].copy_from_slice(&blk[0..2]);
            for j in 0..QK {
                gb[32 + (j / 4) * 64 + lr * 4 + j % 4] = blk[2 + j];
            }
        })
    }
}

impl<F: TileFormat> AmxMatrix<F> {
    /// Builds the groups from file rows of `block_bytes`-byte blocks, `place(block, group
    /// block, row in group)` writing one row's block into its group block.
    fn regroup(
        rows: usize,
        cols: usize,
        file: &[u8],
        block_bytes: usize,
        place: impl Fn(&[u8], &mut [u8], usize),
    ) -> AmxMatrix<F> {
        let nb = cols / QK;
        let mut bytes = vec![0u8; rows.div_ceil(GROUP_ROWS) * nb * F::GROUP_BLOCK_BYTES];
        for r in 0..rows {
            let (g, lr) = (r / GROUP_ROWS, r % GROUP_ROWS);
            let row = &file[r * nb * block_bytes..(r + 1) * nb * block_bytes];
            for (b, blk) in row.chunks_exact(block_bytes).enumerate() {
                let at = (g * nb + b) * F::GROUP_BLOCK_BYTES;
                place(blk, &mut bytes[at..at + F::GROUP_BLOCK_BYTES], lr);
            }
        }
        AmxMatrix {
            rows,
            cols,
            bytes,
            format: std::marker::PhantomData,
        }
    }

    /// Bytes of the matrix in memory (the file's, plus the last group's padding rows).
    pub fn size_in_bytes(&self) -> usize {
        self.bytes.len()
    }

    /// Rows of the matrix (outputs of a matmul).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns of the matrix (values of an input row).
    pub fn cols(&self) -> usize {
        self.cols
    }

    pub(super) fn blocks(&self) -> usize {
        self.cols / QK
    }

    pub(super) fn group_block(&self, g: usize, b: usize) -> &[u8] {
        &self.bytes[(g * self.blocks() + b) * F::GROUP_BLOCK_BYTES..][..F::GROUP_BLOCK_BYTES]
    }

    /// Row `lr` of a group block: its scale, its minimum (0 without), and its 32 integer values
    /// in block order.
    fn row_of(gb: &[u8], lr: usize) -> (f32, f32, [i32; QK]) {
        let d = f16_at(gb, 2 * lr);
        let m = if F::MINIMUMS {
            f16_at(gb, 32 + 2 * lr)
        } else {
            0.0
        };
        let at = |j: usize| gb[F::WEIGHTS_AT + (j / 4) * 64 + lr * 4 + j % 4];
        let q = std::array::from_fn(|j| {
            if F::NIBBLES {
                i32::from(if j < 16 { at(j) & 15 } else { at(j - 16) >> 4 })
            } else {
                i32::from(at(j) as i8)
            }
        });
        (d, m, q)
    }

    /// Rows `ids` as f32 (`[ids.len(), cols]`), the values the file's own matrix gives
    /// (`d·q + m`, or `q·d`); every id must be `< rows`.
    pub fn dequantize_rows(&self, ids: &[u32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(ids.len() * self.cols);
        for &id in ids {
            let (g, lr) = (id as usize / GROUP_ROWS, id as usize % GROUP_ROWS);
            for b in 0..self.blocks() {
                let (d, m, q) = Self::row_of(self.group_block(g, b), lr);
                if F::MINIMUMS {
                    out.extend(q.iter().map(|&q| (q as f32).mul_add(d, m)));
                } else {
                    out.extend(q.iter().map(|&q| q as f32 * d));
                }
            }
        }
        out
    }

    /// `y = x Wᵀ` with the fastest kernel this process runs: AMX tiles where
    /// [`amx_available`], else the vector kernels of [`Isa::active`] (`super::grouped`); the
    /// same bits either way.
    pub fn matmul_q8(&self, x: &Q8Rows) -> Vec<f32> {
        self.matmul_q8_with(Isa::active(), amx_available(), x)
    }

    /// `y = x Wᵀ` on AMX tiles (`amx`) or with the vector kernels of `isa`. Panics where the
    /// CPU runs neither (the modes are refused at load there).
    pub fn matmul_q8_with(&self, isa: Isa, amx: bool, x: &Q8Rows) -> Vec<f32> {
        assert_eq!(x.k, self.cols, "grouped matmul input width");
        assert!(
            if amx {
                amx_available()
            } else {
                isa.supported()
            },
            "{} kernels on a CPU or kernel without them",
            if amx { "AMX" } else { isa.name() }
        );
        let (m, n) = (x.len(), self.rows);
        let mut y = vec![0f32; m * n];
        if m == 0 {
            return y;
        }
        let out = OutPtr(y.as_mut_ptr());
        let xv = x.view();
        let groups = n.div_ceil(GROUP_ROWS);
        candle_core::utils::barrier_pool().execute_chunked(groups, |range| {
            // SAFETY: the CPU runs the kernel picked (asserted above; AMX's tile state is
            // granted where `amx_available`); each item writes only the columns of its
            // groups (`out` holds m rows of n, outliving the call, which returns after every
            // item ran).
            unsafe {
                match amx {
                    #[cfg(target_arch = "x86_64")]
                    true => kernel::groups(self, xv, m, range, &out),
                    _ => super::grouped::groups(isa, self, xv, m, range, &out),
                }
            }
        });
        y
    }

    /// Output `y[t][r]` by the arithmetic of the module docs in plain Rust.
    pub(super) fn reference_output(&self, xv: Q8View<'_>, t: usize, r: usize) -> f32 {
        let nb = self.blocks();
        let (g, lr) = (r / GROUP_ROWS, r % GROUP_ROWS);
        let mut acc = 0f32;
        for b in 0..nb {
            let (dw, mw, qw) = Self::row_of(self.group_block(g, b), lr);
            let qa = &xv.qs[t * self.cols + b * QK..][..QK];
            let s: i32 = qw.iter().zip(qa).map(|(&w, &a)| w * i32::from(a)).sum();
            let (da, sa) = (xv.d[t * nb + b], xv.s[t * nb + b]);
            acc = (s as f32).mul_add(dw * da, acc);
            if F::MINIMUMS {
                acc = mw.mul_add(sa, acc);
            }
        }
        acc
    }

    /// The arithmetic of the module docs in plain Rust, one output at a time: what
    /// [`Self::matmul_q8`] computes, bit for bit, on any CPU.
    pub fn matmul_reference(&self, x: &Q8Rows) -> Vec<f32> {
        assert_eq!(x.k, self.cols, "grouped matmul input width");
        let (m, n) = (x.len(), self.rows);
        let xv = x.view();
        let mut y = vec![0f32; m * n];
        for t in 0..m {
            for r in 0..n {
                y[t * n + r] = self.reference_output(xv, t, r);
            }
        }
        y
    }
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::{AmxMatrix, OutPtr, Q8View, TileFormat, B_TILE_BYTES, GROUP_ROWS, QK, TILE_INPUTS};

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
    pub(super) unsafe fn groups<F: TileFormat>(
        w: &AmxMatrix<F>,
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
    fn unpack_group<F: TileFormat>(w: &AmxMatrix<F>, g: usize, unpacked: &mut [u8]) {
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
        w: &AmxMatrix<F>,
        g: usize,
        unpacked: &[u8],
        x: Q8View<'_>,
        t0: usize,
        out: &OutPtr,
    ) {
        #[repr(C, align(64))]
        struct Sums([[i32; GROUP_ROWS]; TILE_INPUTS]);
        let (k, n, nb) = (w.cols, w.rows, w.blocks());
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
            // SAFETY: 16 f16 scales at 0 and (with minimums) 16 f16 minimums at 32 of the
            // group block.
            let (dw, mw) = unsafe {
                (
                    _mm512_cvtph_ps(_mm256_loadu_si256(gb.as_ptr().cast())),
                    if F::MINIMUMS {
                        _mm512_cvtph_ps(_mm256_loadu_si256(gb.as_ptr().add(32).cast()))
                    } else {
                        _mm512_setzero_ps()
                    },
                )
            };
            for (t, a) in acc.iter_mut().enumerate() {
                let at = (t0 + t) * nb + b;
                // SAFETY: row t of `sums` is 16 aligned i32.
                let s = _mm512_cvtepi32_ps(unsafe { _mm512_load_si512(sums.0[t].as_ptr().cast()) });
                let p = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[at]));
                *a = _mm512_fmadd_ps(s, p, *a);
                if F::MINIMUMS {
                    *a = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[at]), *a);
                }
            }
        }
        let r0 = g * GROUP_ROWS;
        let valid = (n - r0).min(GROUP_ROWS);
        let mask: __mmask16 = if valid == GROUP_ROWS {
            !0
        } else {
            (1 << valid) - 1
        };
        for (t, a) in acc.iter().enumerate() {
            // SAFETY: row t0 + t < m, columns r0..r0 + valid < n: this group's, inside `out`.
            unsafe { _mm512_mask_storeu_ps(out.0.add((t0 + t) * n + r0), mask, *a) };
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A random Q4_1 matrix (f16 scales and minimums of a realistic size).
    pub(in crate::quant) fn random_q4_1(rows: usize, cols: usize, seed: u64) -> Q4_1Matrix {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let mut bytes = Vec::with_capacity(rows * cols / QK * BLOCK_BYTES);
        for _ in 0..rows * cols / QK {
            let d = half::f16::from_f32((next() % 1000) as f32 * 1e-5 + 1e-4);
            let m = half::f16::from_f32(-((next() % 1000) as f32) * 1e-4);
            bytes.extend(d.to_le_bytes());
            bytes.extend(m.to_le_bytes());
            bytes.extend((0..16).map(|_| next() as u8));
        }
        Q4_1Matrix::new(rows, cols, bytes).unwrap()
    }

    pub(in crate::quant) fn random_inputs(m: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..m * k)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    }

    #[test]
    fn the_reference_is_the_q4_1_product_of_the_quantized_inputs() {
        // Against the file's dequantized weights times the dequantized 8-bit inputs in f64.
        let (rows, cols, m) = (37, 96, 5);
        let w = random_q4_1(rows, cols, 1);
        let x = Q8Rows::quantize(&random_inputs(m, cols, 2), cols);
        let y = AmxQ4_1Matrix::new(&w).matmul_reference(&x);
        let ids: Vec<u32> = (0..rows as u32).collect();
        let wf = w.dequantize_rows(&ids);
        assert_eq!(
            AmxQ4_1Matrix::new(&w).dequantize_rows(&ids),
            wf,
            "regrouped rows"
        );
        let xv = x.view();
        for t in 0..m {
            for r in 0..rows {
                let mut want = 0f64;
                for c in 0..cols {
                    let xa =
                        f64::from(xv.qs[t * cols + c]) * f64::from(xv.d[t * cols / QK + c / QK]);
                    want += f64::from(wf[r * cols + c]) * xa;
                }
                let got = f64::from(y[t * rows + r]);
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "y[{t}][{r}] = {got}, want {want}"
                );
            }
        }
    }

    #[test]
    fn the_q8_0_reference_is_the_product_of_the_quantized_inputs() {
        let (rows, cols, m) = (21, 64, 3);
        let mut bytes = Vec::new();
        for i in 0..rows * cols / QK {
            bytes.extend(half::f16::from_f32(0.01 + i as f32 * 1e-4).to_le_bytes());
            bytes.extend((0..QK).map(|j| ((i * 31 + j * 7) % 255) as u8));
        }
        let w = Q8_0Matrix::new(rows, cols, bytes).unwrap();
        let amx = AmxQ8_0Matrix::new(&w);
        let ids: Vec<u32> = (0..rows as u32).collect();
        let wf = w.dequantize_rows(&ids);
        assert_eq!(amx.dequantize_rows(&ids), wf, "regrouped rows");
        let x = Q8Rows::quantize(&random_inputs(m, cols, 3), cols);
        let y = amx.matmul_reference(&x);
        let xv = x.view();
        for t in 0..m {
            for r in 0..rows {
                let want: f64 = (0..cols)
                    .map(|c| {
                        let xa =
                            f64::from(xv.qs[t * cols + c]) * f64::from(xv.d[(t * cols + c) / QK]);
                        f64::from(wf[r * cols + c]) * xa
                    })
                    .sum();
                let got = f64::from(y[t * rows + r]);
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "y[{t}][{r}] {got} {want}"
                );
            }
        }
    }

    /// The AMX kernel against the reference for every batch size that makes a new tile shape,
    /// and row 0 alone against row 0 in each batch.
    fn check_amx<F: TileFormat>(w: &AmxMatrix<F>, all: &[f32], what: &str) {
        let cols = w.cols;
        for m in [1, 3, 16, 17, 40] {
            let x = Q8Rows::quantize(&all[..m * cols], cols);
            let got = w.matmul_q8(&x);
            let want = w.matmul_reference(&x);
            let bad = got
                .iter()
                .zip(&want)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(bad, None, "{what} at batch {m}: first difference");
            let alone = w.matmul_q8(&Q8Rows::quantize(&all[..cols], cols));
            assert_eq!(
                alone[..],
                got[..w.rows],
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
            let mut bytes = Vec::new();
            for i in 0..rows * cols / QK {
                bytes.extend(half::f16::from_f32(0.003 + (i % 13) as f32 * 1e-3).to_le_bytes());
                bytes.extend((0..QK).map(|j| ((i * 131 + j * 17) % 256) as u8));
            }
            let w = AmxQ8_0Matrix::new(&Q8_0Matrix::new(rows, cols, bytes).unwrap());
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
            let w = AmxQ4_1Matrix::new(&random_q4_1(rows, cols, rows as u64));
            let all = random_inputs(40, cols, cols as u64);
            check_amx(&w, &all, &format!("Q4_1 [{rows}, {cols}]"));
        }
    }
}
