//! Quantized matrices regrouped 16 rows at a time for integer dot products with 8-bit
//! activations (`--dtype native-i8` and `native-amx`): the layout AMX tiles read, which the
//! vector kernels read too, a register lane per weight row.
//!
//! - Q4_1 layout ([`GroupedQ4_1Matrix`]): the file's blocks regrouped, same bytes per weight.
//!   Rows are taken 16 at a time (a *group*; the last one padded with zero rows); per group and
//!   block: the 16 rows' f16 scales `d`, their 16 f16 minimums `m`, then the 16 rows' 16
//!   nibble bytes in the order of an AMX B tile: byte `kk * 64 + r * 4 + i` is row `r`'s file
//!   byte `4 * kk + i` (`kk < 4`), whose low nibble is value `4 * kk + i` of the block and whose
//!   high nibble is value `16 + 4 * kk + i`. Masking the low nibbles of 64 bytes gives four
//!   consecutive values of each of the 16 rows, shifting out the high ones the four values 16
//!   later: one instruction's operand for 16 rows (a B tile's row for AMX, a register whose
//!   lane `r` is row `r` for AVX-512).
//! - Q8_0 ([`GroupedQ8_0Matrix`], SmolLM2's tied embedding / lm_head): per group and block the
//!   16 rows' f16 scales, then the block's 512 signed values in the same order (byte
//!   `kk * 64 + r * 4 + i` is row `r`'s value `4 * kk + i`, `kk < 8`); no minimum term.
//! - Arithmetic, per output `y[t][r]`: `acc = 0`; for every block `b` in order,
//!   `acc = fma(s_b, dw·da, acc)` then (Q4_1) `acc = fma(mw, sa, acc)`, with
//!   `s_b = Σ_i qw_i·qa_i` exact in 32-bit integers, `dw·da` rounded to f32, `sa` the
//!   activation block's `d·Σq` ([`Q8Rows`]).
//! - Kernels, picked per call ([`GroupedMatrix::matmul_q8`]): AMX tiles where
//!   [`amx_available`] (`super::amx`), else the vector kernels of [`Isa::active`] (`simd`:
//!   AVX-512 or AVX2, with VNNI where the CPU has it), else portable code. Work is split by
//!   groups over candle's pool.
//!
//! Invariant: every kernel computes each output by the arithmetic above in that order, so all
//! of them equal [`GroupedMatrix::matmul_reference`] bit for bit, on every CPU, and a row's
//! outputs do not depend on the other rows of its batch (tested per kernel and batch shape).

pub(super) mod simd;

use super::amx::amx_available;
#[cfg(target_arch = "x86_64")]
use super::amx::amx_groups;
use super::q8_rows::Q8View;
use super::{OutPtr, Q4_1Matrix, Q8_0Matrix, BLOCK_BYTES, QK};
use crate::cpu::Isa;
use crate::quant::Q8Rows;

/// Weight rows per group: 16 lanes of an AVX-512 register, the 16 columns of a `tdpbssd`
/// result.
pub(super) const GROUP_ROWS: usize = 16;

/// Fewest input rows for which [`GroupedMatrix::matmul_q8`] takes AMX tiles: a tile holds 16
/// rows, and below that the vector kernels win. Measured on an AMX CPU (2 cores, SmolLM2's MLP
/// shapes, `cargo bench -p tandem-models --bench q4_1`): at 1 row AMX took 1.8-2x the VNNI
/// kernel's time, at 16 they tie (up 0.84x, down 1.13x), at 128 AMX is 7-19% faster.
pub const AMX_MIN_ROWS: usize = 32;
/// Bytes of a block's unpacked weights for 16 rows: 8 chunks of 64 bytes (4 consecutive values
/// of 16 rows each), an AMX B tile.
pub(super) const B_TILE_BYTES: usize = 512;

/// How a quantized type's blocks sit in an [`GroupedMatrix`]: per group of 16 rows and block, the
/// rows' f16 scales `d` (bytes 0..32), their f16 minimums `m` if the type has them (32..64),
/// then the block's weights in the order of the module docs.
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

/// A `[rows, cols]` quantized matrix regrouped 16 rows at a time (module docs).
#[derive(Debug, Clone)]
pub struct GroupedMatrix<F> {
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
    format: std::marker::PhantomData<F>,
}

/// Q4_1 regrouped (the layer matrices of `--dtype native-i8` / `native-amx`).
pub type GroupedQ4_1Matrix = GroupedMatrix<Q4_1Tiles>;
/// Q8_0 regrouped (the tied embedding / lm_head of `--dtype native-i8` / `native-amx`).
pub type GroupedQ8_0Matrix = GroupedMatrix<Q8_0Tiles>;

impl GroupedMatrix<Q4_1Tiles> {
    /// Regroups `w` (any CPU can hold the form; only [`amx_available`] ones multiply with AMX).
    pub fn new(w: &Q4_1Matrix) -> GroupedQ4_1Matrix {
        GroupedMatrix::regroup(w.rows, w.cols, &w.bytes, BLOCK_BYTES, |blk, gb, lr| {
            gb[2 * lr..2 * lr + 2].copy_from_slice(&blk[0..2]);
            gb[32 + 2 * lr..32 + 2 * lr + 2].copy_from_slice(&blk[2..4]);
            for j in 0..16 {
                gb[64 + (j / 4) * 64 + lr * 4 + j % 4] = blk[4 + j];
            }
        })
    }
}

impl GroupedMatrix<Q8_0Tiles> {
    /// Regroups `w` (as [`GroupedQ4_1Matrix::new`]).
    pub fn new(w: &Q8_0Matrix) -> GroupedQ8_0Matrix {
        let (rows, cols, bytes) = w.parts();
        GroupedMatrix::regroup(rows, cols, bytes, 34, |blk, gb, lr| {
            gb[2 * lr..2 * lr + 2].copy_from_slice(&blk[0..2]);
            for j in 0..QK {
                gb[32 + (j / 4) * 64 + lr * 4 + j % 4] = blk[2 + j];
            }
        })
    }
}

impl<F: TileFormat> GroupedMatrix<F> {
    /// Builds the groups from file rows of `block_bytes`-byte blocks, `place(block, group
    /// block, row in group)` writing one row's block into its group block.
    fn regroup(
        rows: usize,
        cols: usize,
        file: &[u8],
        block_bytes: usize,
        place: impl Fn(&[u8], &mut [u8], usize),
    ) -> GroupedMatrix<F> {
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
        GroupedMatrix {
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

    /// `y = x Wᵀ` with the fastest kernel this process runs for `x`'s row count: AMX tiles
    /// where [`amx_available`] and there are at least [`AMX_MIN_ROWS`] rows, else the vector
    /// kernels of [`Isa::active`] (`super::grouped`); the same bits either way, so a row's
    /// result never depends on which one its batch got.
    pub fn matmul_q8(&self, x: &Q8Rows) -> Vec<f32> {
        let amx = x.len() >= AMX_MIN_ROWS && amx_available();
        self.matmul_q8_with(Isa::active(), amx, x)
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
                    true => amx_groups(self, xv, m, range, &out),
                    _ => simd::groups(isa, self, xv, m, range, &out),
                }
            }
        });
        y
    }

    /// Outputs `y[t][r]` of weight row `r` for the `m` input rows, by the arithmetic of the
    /// module docs in plain Rust (each row's block decoded once for all inputs).
    pub(super) fn reference_column(&self, xv: Q8View<'_>, m: usize, r: usize) -> Vec<f32> {
        let nb = self.blocks();
        let (g, lr) = (r / GROUP_ROWS, r % GROUP_ROWS);
        let mut acc = vec![0f32; m];
        for b in 0..nb {
            let (dw, mw, qw) = Self::row_of(self.group_block(g, b), lr);
            for (t, a) in acc.iter_mut().enumerate() {
                let qa = &xv.qs[t * self.cols + b * QK..][..QK];
                let s: i32 = qw.iter().zip(qa).map(|(&w, &a)| w * i32::from(a)).sum();
                let (da, sa) = (xv.d[t * nb + b], xv.s[t * nb + b]);
                *a = (s as f32).mul_add(dw * da, *a);
                if F::MINIMUMS {
                    *a = mw.mul_add(sa, *a);
                }
            }
        }
        acc
    }

    /// The arithmetic of the module docs in plain Rust, one weight row at a time on one
    /// thread: what [`Self::matmul_q8`] computes, bit for bit, on any CPU.
    pub fn matmul_reference(&self, x: &Q8Rows) -> Vec<f32> {
        assert_eq!(x.k, self.cols, "grouped matmul input width");
        let (m, n) = (x.len(), self.rows);
        let xv = x.view();
        let mut y = vec![0f32; m * n];
        for r in 0..n {
            for (t, v) in self.reference_column(xv, m, r).into_iter().enumerate() {
                y[t * n + r] = v;
            }
        }
        y
    }
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
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

    /// A Q8_0 matrix whose bytes take every value, -128 included (scales 0.003 to 0.015).
    pub(in crate::quant) fn every_byte_q8_0(rows: usize, cols: usize) -> GroupedQ8_0Matrix {
        let mut bytes = Vec::new();
        for i in 0..rows * cols / QK {
            bytes.extend(half::f16::from_f32(0.003 + (i % 13) as f32 * 1e-3).to_le_bytes());
            bytes.extend((0..QK).map(|j| ((i * 131 + j * 17) % 256) as u8));
        }
        GroupedQ8_0Matrix::new(&Q8_0Matrix::new(rows, cols, bytes).unwrap())
    }

    #[test]
    fn the_reference_is_the_q4_1_product_of_the_quantized_inputs() {
        // Against the file's dequantized weights times the dequantized 8-bit inputs in f64.
        let (rows, cols, m) = (37, 96, 5);
        let w = random_q4_1(rows, cols, 1);
        let x = Q8Rows::quantize(&random_inputs(m, cols, 2), cols);
        let y = GroupedQ4_1Matrix::new(&w).matmul_reference(&x);
        let ids: Vec<u32> = (0..rows as u32).collect();
        let wf = w.dequantize_rows(&ids);
        assert_eq!(
            GroupedQ4_1Matrix::new(&w).dequantize_rows(&ids),
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
        let amx = GroupedQ8_0Matrix::new(&w);
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

    /// One kernel form, as the tests call each.
    type Form<F> = unsafe fn(&GroupedMatrix<F>, Q8View<'_>, usize, std::ops::Range<usize>, &OutPtr);

    /// Every form this CPU runs, by name, and the portable code.
    fn forms<F: TileFormat>() -> Vec<(&'static str, Form<F>)> {
        let mut forms: Vec<(&'static str, Form<F>)> = vec![("portable", |w, x, m, range, out| {
            // SAFETY: the portable variant runs on any CPU.
            unsafe { simd::groups(Isa::Portable, w, x, m, range, out) }
        })];
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = Isa::Avx2.supported();
            let avx512 = Isa::Avx512.supported();
            let candidates: [(&'static str, bool, Form<F>); 4] = [
                ("avx2 pair", avx2, simd::x86::avx2_pair::<F>),
                (
                    "avx2 avx-vnni",
                    avx2 && is_x86_feature_detected!("avxvnni"),
                    simd::x86::avx2_vnni::<F>,
                ),
                ("avx512 pair", avx512, simd::x86::avx512_pair::<F>),
                (
                    "avx512 vnni",
                    avx512 && is_x86_feature_detected!("avx512vnni"),
                    simd::x86::avx512_vnni::<F>,
                ),
            ];
            forms.extend(
                candidates
                    .into_iter()
                    .filter(|c| c.1)
                    .map(|(name, _, f)| (name, f)),
            );
        }
        forms
    }

    /// Each form against the reference, bit for bit, at batch sizes that make every pass
    /// shape; row 0 alone against row 0 in each batch.
    fn check<F: TileFormat>(w: &GroupedMatrix<F>, all: &[f32], what: &str) -> usize {
        let cols = w.cols();
        let groups = w.rows().div_ceil(GROUP_ROWS);
        let run = |form: Form<F>, x: &Q8Rows| {
            let mut y = vec![f32::NAN; x.len() * w.rows()];
            let out = OutPtr(y.as_mut_ptr());
            // SAFETY: `forms` lists only forms this CPU runs; `y` holds m rows of n.
            unsafe { form(w, x.view(), x.len(), 0..groups, &out) };
            y
        };
        let forms = forms::<F>();
        for (name, form) in &forms {
            for m in [1, 3, 4, 5, 8, 9, 16, 17, 40] {
                let x = Q8Rows::quantize(&all[..m * cols], cols);
                let got = run(*form, &x);
                let want = w.matmul_reference(&x);
                let bad = got
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(bad, None, "{what}, {name}, batch {m}: first difference");
                let alone = run(*form, &Q8Rows::quantize(&all[..cols], cols));
                assert_eq!(
                    alone[..],
                    got[..w.rows()],
                    "{what}, {name}: row 0 alone, batch {m}"
                );
            }
        }
        forms.len()
    }

    #[test]
    fn every_form_equals_the_reference_bit_for_bit_q4_1() {
        // 40 and 24 rows end in a part group (and a part half group)
        for (rows, cols) in [(40, 96), (24, 64), (64, 576), (48, 1536)] {
            let w = GroupedQ4_1Matrix::new(&random_q4_1(rows, cols, rows as u64));
            let all = random_inputs(40, cols, cols as u64);
            let ran = check(&w, &all, &format!("Q4_1 [{rows}, {cols}]"));
            assert!(ran >= 1);
        }
    }

    #[test]
    fn every_form_equals_the_reference_bit_for_bit_q8_0() {
        for (rows, cols) in [(40, 96), (48, 576)] {
            let w = every_byte_q8_0(rows, cols);
            let ran = check(
                &w,
                &random_inputs(40, cols, 7),
                &format!("Q8_0 [{rows}, {cols}]"),
            );
            assert!(ran >= 1);
        }
    }

    #[test]
    fn extreme_q8_0_weights_do_not_saturate() {
        // -128 and 127 weights against ±127 activations: the sign trick's worst case, where
        // a pair of products is 2 · 128 · 127, just inside 16 bits
        let (rows, cols) = (24, 64);
        let mut bytes = Vec::new();
        for _ in 0..rows * cols / QK {
            bytes.extend(half::f16::from_f32(1.0).to_le_bytes());
            bytes.extend((0..QK).map(|i| if i % 2 == 0 { 0x80u8 } else { 127 }));
        }
        let w = GroupedQ8_0Matrix::new(&Q8_0Matrix::new(rows, cols, bytes).unwrap());
        let all: Vec<f32> = (0..40 * cols)
            .map(|i| if i % 2 == 0 { -1.0 } else { 1.0 })
            .collect();
        check(&w, &all, "extreme Q8_0");
        // per block 16 · 128 · 127 + 16 · 127 · 127 = 518160, times 1 / 127, two blocks
        let y = w.matmul_q8(&Q8Rows::quantize(&all[..cols], cols));
        for v in y {
            assert!((v - 2.0 * 518160.0 / 127.0).abs() < 1e-2, "{v}");
        }
    }

    #[test]
    fn the_matmul_picks_a_kernel_that_equals_the_reference() {
        let w = GroupedQ4_1Matrix::new(&random_q4_1(40, 96, 3));
        let x = Q8Rows::quantize(&random_inputs(5, 96, 4), 96);
        let want = w.matmul_reference(&x);
        assert_eq!(w.matmul_q8(&x), want);
        for isa in Isa::runnable() {
            assert_eq!(w.matmul_q8_with(isa, false, &x), want, "{}", isa.name());
        }
    }
}
