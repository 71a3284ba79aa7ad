//! A Q4_1 matrix held as the file stores it, and its batched matmul `y = x Wᵀ` with f32 inputs
//! (`--dtype native`: here, tiled, threaded and dispatched per instruction set by `run` over a
//! [`KernelSet`]). With inputs quantized to 8 bits ([`q8_rows`]), the file's Q4_1 and Q8_0
//! matrices are regrouped and multiplied by integer kernels instead ([`grouped`], on AMX tiles
//! in [`amx`]: `--dtype native-i8`).
//!
//! - Layout (ggml's `block_q4_1`, 20 bytes per 32 values): f16 scale `d`, f16 minimum `m`, then
//!   16 bytes whose low nibbles are values 0..16 and high nibbles values 16..32 of the block;
//!   value = `d * q + m`. A row is `cols / 32` blocks; rows follow each other.
//! - Kernel: a block is dequantized to f32 once per pass (two 16-lane halves, `q.mul_add(d, m)`;
//!   AVX-512 looks each nibble up in the block's table of `i.mul_add(d, m)`, the same values)
//!   and multiplied into 16-lane accumulators of up to 8 input rows, for 2 or 4 weight rows at a
//!   time. Three variants, picked at run time (`crate::cpu`): AVX-512, AVX2 (two 8-lane
//!   registers per accumulator, its own tile shapes) and portable code, all with the same
//!   arithmetic (the portable code with fused multiply-adds is the reference; on an x86-64
//!   target without FMA the portable variant rounds products separately). The inputs stay f32:
//!   no activation quantization. Work is split into groups of output rows
//!   on candle's thread pool (the one its matmuls and our attention use); a group's weights
//!   stay in cache while every tile of input rows passes over them.
//!
//! Invariant: every output `y[r][o]` is computed by the same sequence of operations whatever
//! the batch: lane `l` accumulates `w·x` over blocks in order (low half, then high half, each a
//! fused multiply-add), then the 16 lanes are summed by one fixed tree. Tile shapes only decide
//! which outputs share a pass, so a row's result is bit-identical alone or in any batch.

use half::f16;

use crate::cpu::Isa;
use crate::error::ModelError;

mod amx;
mod grouped;
mod q8_0;
mod q8_rows;
pub use amx::amx_available;
pub use grouped::{GroupedMatrix, GroupedQ4_1Matrix, GroupedQ8_0Matrix, TileFormat, AMX_MIN_ROWS};
pub use q8_0::Q8_0Matrix;
pub use q8_rows::Q8Rows;

/// Values per block.
const QK: usize = 32;
/// Bytes per block: `d`, `m` (f16 each), 16 bytes of nibbles.
const BLOCK_BYTES: usize = 20;
/// Output rows per parallel work item.
const GROUP: usize = 32;
/// Input rows per pass over a group's weights.
const MT: usize = 8;

/// A `[rows, cols]` Q4_1 matrix (rows = output features).
#[derive(Debug, Clone)]
pub struct Q4_1Matrix {
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
}

impl Q4_1Matrix {
    pub fn new(rows: usize, cols: usize, bytes: Vec<u8>) -> Result<Self, ModelError> {
        if !cols.is_multiple_of(QK) || bytes.len() != rows * cols / QK * BLOCK_BYTES {
            return Err(ModelError::format(format!(
                "Q4_1 matrix [{rows}, {cols}] given {} bytes",
                bytes.len()
            )));
        }
        Ok(Q4_1Matrix { rows, cols, bytes })
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
                let (d, m) = scale_min(blk);
                let qs = &blk[4..];
                out.extend(qs.iter().map(|&q| f32::from(q & 15).mul_add(d, m)));
                out.extend(qs.iter().map(|&q| f32::from(q >> 4).mul_add(d, m)));
            }
        }
        out
    }

    /// `y = x Wᵀ`: `x` holds `m` rows of `cols`; returns `m` rows of `rows`. Runs the kernel
    /// variant of [`Isa::active`].
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_on(Isa::active(), x, m)
    }

    /// [`Self::matmul`] with the kernel variant for `isa`, which must be one this CPU runs
    /// (a variant it cannot run panics instead of executing unknown instructions).
    pub fn matmul_on(&self, isa: Isa, x: &[f32], m: usize) -> Vec<f32> {
        assert_eq!(x.len(), m * self.cols, "Q4_1 matmul input size");
        run::<Self, &[f32], F32Kernels>(self, isa, x, m)
    }
}

/// `y = x Wᵀ` over `m` input rows with the tile kernels `S` of `isa`: work is split into
/// groups of [`GROUP`] output rows on candle's thread pool.
fn run<W: BlockRows, X: TileInput, S: KernelSet<X>>(w: &W, isa: Isa, x: X, m: usize) -> Vec<f32> {
    assert!(
        isa.supported(),
        "{} kernels on a CPU without them",
        isa.name()
    );
    let n = w.rows();
    let mut y = vec![0f32; m * n];
    let out = OutPtr(y.as_mut_ptr());
    let items = n.div_ceil(GROUP);
    candle_core::utils::barrier_pool().execute_chunked(items, |range| {
        for g in range {
            let rows = g * GROUP..((g + 1) * GROUP).min(n);
            // SAFETY: item `g` writes only columns `rows` of `y` (m rows of n), and items
            // partition the columns; `y` outlives `execute_chunked`, which returns after
            // every item ran. Each variant is entered only for its own `isa`, which the
            // CPU runs (asserted above).
            unsafe {
                match isa {
                    Isa::Portable => group::<W, X, S::Portable>(w, x, m, rows, &out),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => group_avx2::<W, X, S::Avx2>(w, x, m, rows, &out),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => group_avx512::<W, X, S::Avx512>(w, x, m, rows, &out),
                    #[cfg(not(target_arch = "x86_64"))]
                    _ => unreachable!("{} is never supported off x86-64", isa.name()),
                }
            }
        }
    });
    y
}

/// # Safety
/// As [`group`], and the CPU has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2<W: BlockRows, X: TileInput, K: TileKernel<X>>(
    w: &W,
    x: X,
    m: usize,
    orows: std::ops::Range<usize>,
    out: &OutPtr,
) {
    // SAFETY: the caller's contract.
    unsafe { group::<W, X, K>(w, x, m, orows, out) }
}

/// # Safety
/// As [`group`], and the CPU has AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn group_avx512<W: BlockRows, X: TileInput, K: TileKernel<X>>(
    w: &W,
    x: X,
    m: usize,
    orows: std::ops::Range<usize>,
    out: &OutPtr,
) {
    // SAFETY: the caller's contract.
    unsafe { group::<W, X, K>(w, x, m, orows, out) }
}

/// Columns `orows` of every output row, with the tile kernel `K` (inlined into each
/// variant's entry point, so the code around the kernel is compiled for its ISA too).
///
/// # Safety
/// `out` points at `m * self.rows` f32 that nobody else reads or writes in columns `orows`
/// while this runs; the CPU runs `K`'s instruction set.
#[inline(always)]
unsafe fn group<W: BlockRows, X: TileInput, K: TileKernel<X>>(
    w: &W,
    x: X,
    m: usize,
    orows: std::ops::Range<usize>,
    out: &OutPtr,
) {
    let (k, n) = (w.cols(), w.rows());
    let mut r0 = 0;
    while r0 < m {
        let mt = (m - r0).min(K::INPUT_ROWS);
        let xt = x.rows(r0, mt, k);
        let mut o = orows.start;
        while o < orows.end {
            let mut sums = [[0f32; 4]; MT];
            let nr = K::weight_rows(mt, orows.end - o);
            // SAFETY (the three calls): the CPU runs `K` (the caller's contract).
            match nr {
                1 => unsafe { tile_dispatch::<1, W, X, K>(w, o, xt, mt, &mut sums) },
                2 => unsafe { tile_dispatch::<2, W, X, K>(w, o, xt, mt, &mut sums) },
                _ => unsafe { tile_dispatch::<4, W, X, K>(w, o, xt, mt, &mut sums) },
            }
            for (r, s) in sums.iter().enumerate().take(mt) {
                for (j, &v) in s.iter().enumerate().take(nr) {
                    // SAFETY: (r0 + r) < m and o + j < orows.end <= n: inside `out`, in
                    // this group's columns (the caller's contract).
                    unsafe { *out.0.add((r0 + r) * n + o + j) = v };
                }
            }
            o += nr;
        }
        r0 += mt;
    }
}

/// A matrix of quantized blocks, row after row, as the tile kernels read it.
trait BlockRows: Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// The bytes of row `r` (`r < rows`).
    fn row(&self, r: usize) -> &[u8];
}

impl BlockRows for Q4_1Matrix {
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

/// The output buffer, shared by the pool's threads; each writes its own columns.
struct OutPtr(*mut f32);
// SAFETY: the pointer is only written through at disjoint indices (see `Q4_1Matrix::matmul`).
unsafe impl Sync for OutPtr {}
unsafe impl Send for OutPtr {}

/// `d` and `m` of a block.
fn scale_min(blk: &[u8]) -> (f32, f32) {
    (
        f16::from_le_bytes([blk[0], blk[1]]).to_f32(),
        f16::from_le_bytes([blk[2], blk[3]]).to_f32(),
    )
}

/// One instruction set's tile: weight rows `rows` against the `M` input rows of `xt`
/// (`sums[r][j] = x_r · w_j`), with exactly `portable::tile`'s arithmetic. Tile shapes only
/// decide which outputs share a pass (module invariant), so each kernel picks its own.
trait TileKernel<X> {
    /// Input rows per pass over a group's weights (at most [`MT`]).
    const INPUT_ROWS: usize = MT;

    /// Weight rows per tile (1, 2 or 4, at most `left`) for a pass of `mt` input rows: at most
    /// 16 accumulators (the AVX-512 form reduces 16 at once and has registers for them).
    #[inline(always)]
    fn weight_rows(mt: usize, left: usize) -> usize {
        match (mt, left) {
            (_, 1) => 1,
            (5.., 2..) | (_, 2 | 3) => 2,
            _ => 4,
        }
    }

    /// # Safety
    /// The CPU runs the kernel's instruction set.
    unsafe fn tile<const NR: usize, const M: usize>(
        rows: [&[u8]; NR],
        xt: X,
        sums: &mut [[f32; 4]; MT],
    );
}

/// Input rows as a tile kernel reads them (f32 rows, `&[f32]`). Copied into every work item.
trait TileInput: Copy + Send + Sync {
    /// Rows `r0..r0 + mt` of rows `k` values long.
    fn rows(self, r0: usize, mt: usize, k: usize) -> Self;
}

impl TileInput for &[f32] {
    fn rows(self, r0: usize, mt: usize, k: usize) -> Self {
        &self[r0 * k..(r0 + mt) * k]
    }
}

/// The tile kernels of one input kind, one per instruction set.
trait KernelSet<X> {
    type Portable: TileKernel<X>;
    #[cfg(target_arch = "x86_64")]
    type Avx2: TileKernel<X>;
    #[cfg(target_arch = "x86_64")]
    type Avx512: TileKernel<X>;
}

/// The f32-input kernels.
struct F32Kernels;

impl KernelSet<&[f32]> for F32Kernels {
    type Portable = portable::Kernel;
    #[cfg(target_arch = "x86_64")]
    type Avx2 = avx2::Kernel;
    #[cfg(target_arch = "x86_64")]
    type Avx512 = avx512::Kernel;
}

/// Weight rows `o..o + NR` against the `mt` rows of `xt`: `sums[r][j] = x_r · w_{o+j}`.
///
/// # Safety
/// The CPU runs `K`'s instruction set.
#[inline(always)]
unsafe fn tile_dispatch<const NR: usize, W: BlockRows, X: TileInput, K: TileKernel<X>>(
    w: &W,
    o: usize,
    xt: X,
    mt: usize,
    sums: &mut [[f32; 4]; MT],
) {
    let rows: [&[u8]; NR] = std::array::from_fn(|j| w.row(o + j));
    macro_rules! go {
        ($($m:literal)|*) => {
            match mt {
                // SAFETY: the caller's contract.
                $($m => unsafe { K::tile::<NR, $m>(rows, xt, sums) },)*
                _ => unreachable!("tile of {mt} rows"),
            }
        };
    }
    go!(1 | 2 | 3 | 4 | 5 | 6 | 7 | 8)
}

/// Sum of 16 lanes by the fixed tree: halves added pairwise (lane `i` + lane `i + 8`, then
/// `i + 4`, `i + 2`, `i + 1`). The AVX-512 reduction computes exactly this.
fn tree_sum(mut p: [f32; 16]) -> f32 {
    let mut s = 8;
    while s > 0 {
        for i in 0..s {
            p[i] += p[i + s];
        }
        s /= 2;
    }
    p[0]
}

/// The kernel in plain Rust. [`tile`] (fused multiply-adds) is the reference the SIMD variants
/// compute exactly; the portable variant runs it where FMA is an instruction of the build's
/// target, and otherwise the same loop with separate multiplies and adds (libm's exact `fmaf`
/// costs ~100x, and no SIMD variant runs on a CPU without FMA to be compared with).
mod portable {
    use super::{scale_min, tree_sum, TileKernel, BLOCK_BYTES, MT, QK};

    pub(super) struct Kernel;

    /// Whether the build's target has FMA instructions (so `mul_add` is one).
    pub(super) const HARDWARE_FMA: bool =
        cfg!(any(target_feature = "fma", not(target_arch = "x86_64")));

    impl TileKernel<&[f32]> for Kernel {
        #[inline(always)]
        unsafe fn tile<const NR: usize, const M: usize>(
            rows: [&[u8]; NR],
            xt: &[f32],
            sums: &mut [[f32; 4]; MT],
        ) {
            tile_with::<NR, M, HARDWARE_FMA>(rows, xt, sums)
        }
    }

    /// The reference: every multiply-add fused.
    #[cfg(test)]
    pub(super) fn tile<const NR: usize, const M: usize>(
        rows: [&[u8]; NR],
        xt: &[f32],
        sums: &mut [[f32; 4]; MT],
    ) {
        tile_with::<NR, M, true>(rows, xt, sums)
    }

    /// `a * b + c`, rounded once when `FUSED`.
    #[inline(always)]
    fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
        if FUSED {
            a.mul_add(b, c)
        } else {
            a * b + c
        }
    }

    #[inline(always)]
    fn tile_with<const NR: usize, const M: usize, const FUSED: bool>(
        rows: [&[u8]; NR],
        xt: &[f32],
        sums: &mut [[f32; 4]; MT],
    ) {
        let k = xt.len() / M;
        let mut acc = [[[0f32; 16]; NR]; M];
        for b in 0..k / QK {
            let mut lo = [[0f32; 16]; NR];
            let mut hi = [[0f32; 16]; NR];
            for j in 0..NR {
                let blk = &rows[j][b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
                let (d, m) = scale_min(blk);
                for l in 0..16 {
                    lo[j][l] = madd::<FUSED>(f32::from(blk[4 + l] & 15), d, m);
                    hi[j][l] = madd::<FUSED>(f32::from(blk[4 + l] >> 4), d, m);
                }
            }
            for r in 0..M {
                let xb = &xt[r * k + b * QK..][..QK];
                for j in 0..NR {
                    for l in 0..16 {
                        acc[r][j][l] = madd::<FUSED>(lo[j][l], xb[l], acc[r][j][l]);
                        acc[r][j][l] = madd::<FUSED>(hi[j][l], xb[16 + l], acc[r][j][l]);
                    }
                }
            }
        }
        for r in 0..M {
            for j in 0..NR {
                sums[r][j] = tree_sum(acc[r][j]);
            }
        }
    }
}

/// AVX-512 form of `portable::tile`: 16-lane registers, nibbles looked up in a per-block table.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{TileKernel, BLOCK_BYTES, MT, QK};
    use crate::ops::simd::reduce16;

    pub(super) struct Kernel;

    impl TileKernel<&[f32]> for Kernel {
        #[inline(always)]
        unsafe fn tile<const NR: usize, const M: usize>(
            rows: [&[u8]; NR],
            xt: &[f32],
            sums: &mut [[f32; 4]; MT],
        ) {
            // SAFETY: the caller's contract (the CPU has AVX-512F).
            unsafe { tile::<NR, M>(rows, xt, sums) }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F and F16C.
    #[inline(always)]
    unsafe fn tile<const NR: usize, const M: usize>(
        rows: [&[u8]; NR],
        xt: &[f32],
        sums: &mut [[f32; 4]; MT],
    ) {
        let k = xt.len() / M;
        let nb = k / QK;
        assert!(M <= MT && NR <= 4 && M * NR <= 16 && xt.len() == M * k && k.is_multiple_of(QK));
        assert!(rows.iter().all(|r| r.len() == nb * BLOCK_BYTES));
        // SAFETY: a block `b < nb` of row `j` is read at bytes `b * 20 + 4..b * 20 + 20` of
        // `rows[j]` (length `nb * 20`), inputs at `xt[r * k + b * 32..][..32]` with `r < M`
        // (length `M * k`): all in bounds by the asserts. The CPU has AVX-512F (the caller's
        // contract).
        unsafe {
            // `iota[i] = i`: a block's 16 possible values `fma(i, d, m)` form a table that
            // `vpermps` indexes by the low 4 bits of each lane (the nibble), which gives
            // exactly `fma(q, d, m)` without converting every nibble.
            let iota = _mm512_setr_ps(
                0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.,
            );
            let mut acc = [[_mm512_setzero_ps(); NR]; M];
            for b in 0..nb {
                let mut lo = [_mm512_setzero_ps(); NR];
                let mut hi = [_mm512_setzero_ps(); NR];
                for j in 0..NR {
                    let blk = rows[j].as_ptr().add(b * BLOCK_BYTES);
                    let dm = _mm512_cvtph_ps(_mm256_castsi128_si256(_mm_cvtsi32_si128(
                        blk.cast::<i32>().read_unaligned(),
                    )));
                    let d = _mm512_broadcastss_ps(_mm512_castps512_ps128(dm));
                    let m = _mm512_permutexvar_ps(_mm512_set1_epi32(1), dm);
                    let table = _mm512_fmadd_ps(iota, d, m);
                    let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(blk.add(4).cast()));
                    lo[j] = _mm512_permutexvar_ps(q, table);
                    hi[j] = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table);
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let xp = xt.as_ptr().add(r * k + b * QK);
                    let (xl, xh) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
                    for j in 0..NR {
                        acc_r[j] = _mm512_fmadd_ps(lo[j], xl, acc_r[j]);
                        acc_r[j] = _mm512_fmadd_ps(hi[j], xh, acc_r[j]);
                    }
                }
            }
            // Reduce up to 16 accumulators at once; unused slots are zero and never mix with
            // the others (each output lane sums only its own vector's lanes).
            let mut v = [_mm512_setzero_ps(); 16];
            for r in 0..M {
                for j in 0..NR {
                    v[r * NR + j] = acc[r][j];
                }
            }
            let mut out = [0f32; 16];
            reduce16(&v, &mut out);
            for r in 0..M {
                sums[r][..NR].copy_from_slice(&out[r * NR..(r + 1) * NR]);
            }
        }
    }
}

/// AVX2 form of `portable::tile`: each 16-lane accumulator of the portable code is two 8-lane
/// registers (lanes 0..8 and 8..16), nibbles converted (`fma(q, d, m)`, the same values). With
/// 16 registers, a pass takes 4 input rows and one weight row (two at batch 1), and the block's
/// low halves are applied to every row before its high halves (each lane still adds the low
/// product first), so accumulators, weights and inputs stay in registers.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{TileKernel, BLOCK_BYTES, MT, QK};
    use crate::ops::simd::reduce8;

    pub(super) struct Kernel;

    impl TileKernel<&[f32]> for Kernel {
        const INPUT_ROWS: usize = 4;

        #[inline(always)]
        fn weight_rows(mt: usize, left: usize) -> usize {
            if mt == 1 && left >= 2 {
                2
            } else {
                1
            }
        }

        #[inline(always)]
        unsafe fn tile<const NR: usize, const M: usize>(
            rows: [&[u8]; NR],
            xt: &[f32],
            sums: &mut [[f32; 4]; MT],
        ) {
            let k = xt.len() / M;
            let nb = k / QK;
            assert!(M <= MT && NR <= 4 && xt.len() == M * k && k.is_multiple_of(QK));
            assert!(rows.iter().all(|r| r.len() == nb * BLOCK_BYTES));
            // SAFETY: block `b < nb` of row `j` is read at bytes `b * 20..b * 20 + 20` of
            // `rows[j]` (length `nb * 20`), inputs at `xt[r * k + b * 32..][..32]` with `r < M`
            // (length `M * k`): in bounds by the asserts. The CPU has AVX2, FMA and F16C (the
            // caller's contract).
            unsafe {
                let low4 = _mm256_set1_epi32(15);
                let mut acc = [[[_mm256_setzero_ps(); 2]; NR]; M];
                for b in 0..nb {
                    let mut dm = [(_mm256_setzero_ps(), _mm256_setzero_ps()); NR];
                    for (j, dmj) in dm.iter_mut().enumerate() {
                        let blk = rows[j].as_ptr().add(b * BLOCK_BYTES);
                        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(blk.cast::<i32>().read_unaligned()));
                        *dmj = (
                            _mm256_broadcastss_ps(v),
                            _mm256_broadcastss_ps(_mm_movehdup_ps(v)),
                        );
                    }
                    // low nibbles are values 0..16 of the block, high nibbles 16..32
                    for half in 0..2 {
                        let mut w = [[_mm256_setzero_ps(); 2]; NR];
                        for (j, wj) in w.iter_mut().enumerate() {
                            let blk = rows[j].as_ptr().add(b * BLOCK_BYTES + 4);
                            for (part, wp) in wj.iter_mut().enumerate() {
                                let q =
                                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(blk.add(8 * part).cast()));
                                let q = if half == 0 {
                                    _mm256_and_si256(q, low4)
                                } else {
                                    _mm256_srli_epi32::<4>(q)
                                };
                                *wp = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), dm[j].0, dm[j].1);
                            }
                        }
                        for (r, acc_r) in acc.iter_mut().enumerate() {
                            let xp = xt.as_ptr().add(r * k + b * QK + 16 * half);
                            let x = [_mm256_loadu_ps(xp), _mm256_loadu_ps(xp.add(8))];
                            for (a, wj) in acc_r.iter_mut().zip(&w) {
                                for part in 0..2 {
                                    a[part] = _mm256_fmadd_ps(wj[part], x[part], a[part]);
                                }
                            }
                        }
                    }
                }
                for r in 0..M {
                    for j in 0..NR {
                        // the portable tree: lane i + lane i + 8 first, then + 4, + 2, + 1
                        let v = _mm256_add_ps(acc[r][j][0], acc[r][j][1]);
                        sums[r][j] = reduce8(v);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random numbers (xorshift).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn f(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    /// Random Q4_1 blocks: random nibbles, scales in (0, 0.05], minimums in [-0.4, 0.4].
    pub(super) fn random_matrix(rows: usize, cols: usize, seed: u64) -> Q4_1Matrix {
        let mut rng = Rng(seed);
        let mut bytes = Vec::with_capacity(rows * cols / QK * BLOCK_BYTES);
        for _ in 0..rows * cols / QK {
            let d = f16::from_f32(0.025 * (rng.f() + 1.0) + 1e-3);
            let m = f16::from_f32(0.4 * rng.f());
            bytes.extend(d.to_le_bytes());
            bytes.extend(m.to_le_bytes());
            bytes.extend((0..16).map(|_| rng.next() as u8));
        }
        Q4_1Matrix::new(rows, cols, bytes).unwrap()
    }

    pub(super) fn random_input(m: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng(seed);
        (0..m * k).map(|_| rng.f()).collect()
    }

    /// Dequantize from the block layout directly, then f64 dots.
    fn naive(w: &Q4_1Matrix, x: &[f32], m: usize) -> Vec<f64> {
        let k = w.cols;
        let mut wf = vec![0f64; w.rows * k];
        for (i, blk) in w.bytes.chunks_exact(BLOCK_BYTES).enumerate() {
            let d = f16::from_le_bytes([blk[0], blk[1]]).to_f64();
            let mn = f16::from_le_bytes([blk[2], blk[3]]).to_f64();
            for j in 0..16 {
                wf[i * QK + j] = d * f64::from(blk[4 + j] & 0x0F) + mn;
                wf[i * QK + j + 16] = d * f64::from(blk[4 + j] >> 4) + mn;
            }
        }
        let mut y = vec![0f64; m * w.rows];
        for r in 0..m {
            for o in 0..w.rows {
                y[r * w.rows + o] = (0..k)
                    .map(|c| wf[o * k + c] * f64::from(x[r * k + c]))
                    .sum();
            }
        }
        y
    }

    #[test]
    fn matmul_matches_dequantized_dot() {
        for (rows, cols) in [(37, 96), (1, 32), (67, 576), (130, 1536)] {
            let w = random_matrix(rows, cols, 7 + rows as u64);
            for (m, isa) in [1, 3, 16, 200]
                .into_iter()
                .flat_map(|m| Isa::runnable().into_iter().map(move |i| (m, i)))
            {
                let x = random_input(m, cols, 99 + m as u64);
                let got = w.matmul_on(isa, &x, m);
                let want = naive(&w, &x, m);
                // relative to the size of the terms: cancellation makes small sums noisy
                let scale = (cols as f64).sqrt() * 0.5;
                for (i, (&g, &e)) in got.iter().zip(&want).enumerate() {
                    let err = (f64::from(g) - e).abs() / e.abs().max(scale);
                    assert!(
                        err < 1e-4,
                        "{isa:?} [{rows}, {cols}] m={m} #{i}: {g} vs {e}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_row_is_the_same_alone_and_in_any_batch() {
        let (rows, cols) = (75, 576); // not a multiple of any tile
        let w = random_matrix(rows, cols, 3);
        let x = random_input(200, cols, 4);
        for isa in Isa::runnable() {
            let in_200 = w.matmul_on(isa, &x, 200);
            for m in [1, 3, 16, 200] {
                let batch = w.matmul_on(isa, &x[..m * cols], m);
                for r in [0, m / 2, m - 1] {
                    let alone = w.matmul_on(isa, &x[r * cols..(r + 1) * cols], 1);
                    let at = format!("{isa:?} m={m} row {r}");
                    assert_eq!(&batch[r * rows..(r + 1) * rows], &alone[..], "{at}");
                    assert_eq!(&in_200[r * rows..(r + 1) * rows], &alone[..], "{at}");
                }
            }
        }
    }

    #[test]
    fn every_variant_this_cpu_runs_equals_the_portable_kernel_bit_for_bit() {
        // the portable variant is the reference only where the target has FMA (module docs)
        let runnable: Vec<Isa> = Isa::runnable()
            .into_iter()
            .filter(|&i| i != Isa::Portable || portable::HARDWARE_FMA)
            .collect();
        eprintln!("variants run: {runnable:?}");
        for (rows, cols) in [(11, 160), (75, 576), (4, 32)] {
            let w = random_matrix(rows, cols, 5 + rows as u64);
            for m in [1, 3, MT, 13] {
                let x = random_input(m, cols, 6 + m as u64);
                let mut want = vec![0f32; m * rows];
                for o in 0..rows {
                    for r0 in (0..m).step_by(MT) {
                        let mt = (m - r0).min(MT);
                        let mut sums = [[0f32; 4]; MT];
                        let xt = &x[r0 * cols..(r0 + mt) * cols];
                        macro_rules! one {
                            ($($n:literal)|*) => { match mt {
                                $($n => portable::tile::<1, $n>([w.row(o)], xt, &mut sums),)*
                                _ => unreachable!(),
                            } };
                        }
                        one!(1 | 2 | 3 | 4 | 5 | 6 | 7 | 8);
                        for r in 0..mt {
                            want[(r0 + r) * rows + o] = sums[r][0];
                        }
                    }
                }
                for &isa in &runnable {
                    let got = w.matmul_on(isa, &x, m);
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
    fn dequantized_rows_follow_the_layout() {
        let w = random_matrix(5, 64, 8);
        let got = w.dequantize_rows(&[4, 1]);
        let eye: Vec<f32> = (0..64 * 64)
            .map(|i| if i % 65 == 0 { 1.0 } else { 0.0 })
            .collect();
        // W·e_c = column c of W: the matmul against the identity reads every weight back
        let all = w.matmul(&eye, 64);
        for c in 0..64 {
            assert_eq!(got[c], all[c * 5 + 4]);
            assert_eq!(got[64 + c], all[c * 5 + 1]);
        }
        let naive_w = naive(&w, &eye, 64);
        for c in 0..64 {
            assert!((f64::from(got[c]) - naive_w[c * 5 + 4]).abs() < 1e-6);
        }
    }
}
