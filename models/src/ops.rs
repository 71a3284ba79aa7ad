//! The element-wise building blocks of a transformer layer, on row-major f32 slices.
//!
//! - [`rms_norm`]: `w * (x / sqrt(mean(x²) + eps))`, per row, in the order HF transformers uses.
//! - [`RopeTable`]: rotary embeddings in the "rotate half" (GPT-NeoX / HF) convention, with the
//!   model's theta and optional scaling (linear, llama3, per-frequency factors from GGUF);
//!   cos/sin precomputed for every position up to the model's maximum.
//! - [`silu_mul`]: SwiGLU's `silu(gate) * up`.
//! - [`rotate_blocks`] / [`unrotate_blocks`]: the orthogonal per-256 rotation (random signs, then
//!   Hadamard) that the Q8_0 weight mode applies to matmul inputs.
//! - [`dot`] / [`axpy`] / [`exp_fast`]: small vector kernels written so the compiler vectorizes
//!   them.
//!
//! Invariant: every function here is deterministic and independent of how rows are batched,
//! so a token's result never depends on the other tokens of the step.

use crate::cpu::isa_variants;
use crate::error::ModelError;

isa_variants! {
    /// RMSNorm of each row of `x` (`[rows, w.len()]`) in place.
    pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
        let d = w.len();
        for row in x.chunks_exact_mut(d) {
            let ss = dot(row, row);
            let r = 1.0 / (ss / d as f32 + eps).sqrt();
            for (v, &g) in row.iter_mut().zip(w) {
                *v = g * (*v * r);
            }
        }
    }
}

/// RMSNorm of each row of `x` into a new buffer.
pub fn rms_norm_to(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rms_norm(&mut out, w, eps);
    out
}

isa_variants! {
    /// `gate_up` holds rows `[gate (n), up (n)]`; returns rows of `silu(gate) * up` (`n` wide).
    pub fn silu_mul(gate_up: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; gate_up.len() / 2];
        for (row, o) in gate_up.chunks_exact(2 * n).zip(out.chunks_exact_mut(n)) {
            let (g, u) = row.split_at(n);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = (g / (1.0 + exp_fast(-g))) * u;
            }
        }
        out
    }
}

/// `gate_up` holds rows `[gate (n), up (n)]`; returns rows of `gelu_tanh(gate) * up` (`n` wide),
/// GELU in its tanh approximation (PyTorch's `gelu(approximate="tanh")`, Gemma's activation).
pub fn gelu_tanh_mul(gate_up: &[f32], n: usize) -> Vec<f32> {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let mut out = Vec::with_capacity(gate_up.len() / 2);
    for row in gate_up.chunks_exact(2 * n) {
        let (g, u) = row.split_at(n);
        out.extend(g.iter().zip(u).map(|(&g, &u)| {
            let inner = SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g);
            0.5 * g * (1.0 + inner.tanh()) * u
        }));
    }
    out
}

isa_variants! {
    /// `x += y`, element-wise.
    pub fn add_assign(x: &mut [f32], y: &[f32]) {
        for (a, b) in x.iter_mut().zip(y) {
            *a += b;
        }
    }
}

/// Width of the blocks [`rotate_blocks`] rotates.
pub const HADAMARD_BLOCK: usize = 256;

/// Fixed pseudo-random signs (`D`), one per position of a block.
fn block_signs() -> &'static [f32; HADAMARD_BLOCK] {
    static SIGNS: std::sync::OnceLock<[f32; HADAMARD_BLOCK]> = std::sync::OnceLock::new();
    SIGNS.get_or_init(|| {
        let mut s = [0f32; HADAMARD_BLOCK];
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for v in s.iter_mut() {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            *v = if state >> 63 == 0 { 1.0 } else { -1.0 };
        }
        s
    })
}

/// The 16×16 Sylvester Hadamard matrix (entries ±1): `H16[j][l] = (-1)^popcount(j & l)`.
fn h16() -> &'static [[f32; 16]; 16] {
    static H: std::sync::OnceLock<[[f32; 16]; 16]> = std::sync::OnceLock::new();
    H.get_or_init(|| {
        let mut h = [[0f32; 16]; 16];
        for (j, row) in h.iter_mut().enumerate() {
            for (l, v) in row.iter_mut().enumerate() {
                *v = if (j & l).count_ones() % 2 == 0 {
                    1.0
                } else {
                    -1.0
                };
            }
        }
        h
    })
}

/// Multiplies every 256-wide block of `x` by the orthonormal Sylvester Hadamard matrix
/// (`H = Hᵀ = H⁻¹`, entries `±1/16`), in place. `H256 = H16 ⊗ H16`: each 16-wide chunk is
/// multiplied by `H16` (a small vectorized matmul), then the fast Walsh–Hadamard butterflies
/// combine whole chunks.
#[inline(always)]
fn hadamard_blocks(x: &mut [f32], h: &[[f32; 16]; 16]) {
    let scale = 1.0 / (HADAMARD_BLOCK as f32).sqrt();
    for b in x.chunks_exact_mut(HADAMARD_BLOCK) {
        for c in b.chunks_exact_mut(16) {
            let src: [f32; 16] = (&*c).try_into().unwrap();
            let mut out = [0f32; 16];
            for (s, row) in src.iter().zip(h) {
                for l in 0..16 {
                    out[l] += s * row[l];
                }
            }
            c.copy_from_slice(&out);
        }
        let mut w = 16;
        while w < HADAMARD_BLOCK {
            for i in (0..HADAMARD_BLOCK).step_by(2 * w) {
                let (lo, hi) = b[i..i + 2 * w].split_at_mut(w);
                for (a, c) in lo.iter_mut().zip(hi.iter_mut()) {
                    let (u, v) = (*a, *c);
                    *a = u + v;
                    *c = u - v;
                }
            }
            w *= 2;
        }
        b.iter_mut().for_each(|v| *v *= scale);
    }
}

/// Rotates every 256-wide block of `x` by the orthogonal `R = D·H` (random signs, then a
/// Hadamard transform): `(x R)·(w R) = x·w`, while `x R` has its outliers spread evenly over
/// the block, which is what per-256 activation quantization needs. `x.len()` must be a
/// multiple of 256.
pub fn rotate_blocks(x: &mut [f32]) {
    debug_assert_eq!(x.len() % HADAMARD_BLOCK, 0);
    rotate_with(x, block_signs(), h16());
}

isa_variants! {
    fn rotate_with(x: &mut [f32], d: &[f32; HADAMARD_BLOCK], h: &[[f32; 16]; 16]) {
        for b in x.chunks_exact_mut(HADAMARD_BLOCK) {
            b.iter_mut().zip(d).for_each(|(v, s)| *v *= s);
        }
        hadamard_blocks(x, h);
    }
}

/// The inverse of [`rotate_blocks`] (`Rᵀ = H·D`).
pub fn unrotate_blocks(x: &mut [f32]) {
    debug_assert_eq!(x.len() % HADAMARD_BLOCK, 0);
    unrotate_with(x, block_signs(), h16());
}

isa_variants! {
    fn unrotate_with(x: &mut [f32], d: &[f32; HADAMARD_BLOCK], h: &[[f32; 16]; 16]) {
        hadamard_blocks(x, h);
        for b in x.chunks_exact_mut(HADAMARD_BLOCK) {
            b.iter_mut().zip(d).for_each(|(v, s)| *v *= s);
        }
    }
}

const LANES: usize = 16;

/// Dot product with independent lanes (four 16-lane accumulators, so it vectorizes into
/// independent FMA chains; the summation order is fixed).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    let mut acc = [[0f32; LANES]; 4];
    let mut i = 0;
    while i + 4 * LANES <= n {
        for (j, aj) in acc.iter_mut().enumerate() {
            let o = i + j * LANES;
            let x: &[f32; LANES] = a[o..o + LANES].try_into().unwrap();
            let y: &[f32; LANES] = b[o..o + LANES].try_into().unwrap();
            for l in 0..LANES {
                aj[l] += x[l] * y[l];
            }
        }
        i += 4 * LANES;
    }
    while i + LANES <= n {
        let x: &[f32; LANES] = a[i..i + LANES].try_into().unwrap();
        let y: &[f32; LANES] = b[i..i + LANES].try_into().unwrap();
        for l in 0..LANES {
            acc[0][l] += x[l] * y[l];
        }
        i += LANES;
    }
    let mut tail = 0f32;
    for (x, y) in a[i..n].iter().zip(&b[i..n]) {
        tail += x * y;
    }
    let mut v = [0f32; LANES];
    for l in 0..LANES {
        v[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    }
    // pairwise reduction of the lanes
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            v[l] += v[l + w];
        }
    }
    v[0] + tail
}

/// `e^x` in f32, branch-free so that loops over it vectorize (Cephes `expf`: range reduction
/// by `ln 2`, degree-6 polynomial; relative error below 2e-7). Inputs below -87.3 give
/// ~1e-38 instead of smaller values or 0.
#[inline(always)]
pub fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.33, 88.72);
    // floor by truncation (exact here, |t| < 2^7): one SSE2 instruction where `floor` is a
    // libm call on the plain x86-64 target
    let t = x * LOG2E + 0.5;
    let fx = t as i32 as f32;
    let fx = if fx > t { fx - 1.0 } else { fx };
    let r = x - fx * C1 - fx * C2;
    let z = r * r;
    let mut y = 1.987_569_1e-4f32;
    y = y * r + 1.398_199_9e-3;
    y = y * r + 8.333_452e-3;
    y = y * r + 4.166_579_6e-2;
    y = y * r + 1.666_666_5e-1;
    y = y * r + 0.5;
    y = y * z + r + 1.0;
    y * f32::from_bits(((fx as i32 + 127) as u32) << 23)
}

/// `x = e^(x - m)` for every element; returns the sum of the results.
#[inline(always)]
pub fn exp_sub_sum(xs: &mut [f32], m: f32) -> f32 {
    for x in xs.iter_mut() {
        *x = exp_fast(*x - m);
    }
    let mut acc = [0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += a * x`.
#[inline(always)]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yv, &xv) in y.iter_mut().zip(x) {
        *yv += a * xv;
    }
}

/// How RoPE frequencies are scaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor`.
    Linear { factor: f32 },
    /// Llama 3.x frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
    /// Per-frequency divisors (GGUF `rope_freqs.weight`, which llama.cpp writes for Llama 3).
    FreqFactors(Vec<f32>),
}

/// Precomputed cos/sin of every position, for "rotate half" RoPE over the first `rotary_dim`
/// dimensions of each head.
#[derive(Debug, Clone)]
pub struct RopeTable {
    half: usize,
    max_positions: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// The inverse frequencies, as HF transformers computes them (f32 arithmetic).
    pub fn inv_freq(
        theta: f32,
        rotary_dim: usize,
        scaling: Option<&RopeScaling>,
    ) -> Result<Vec<f32>, ModelError> {
        let half = rotary_dim / 2;
        let mut inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / rotary_dim as f32))
            .collect();
        match scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => inv.iter_mut().for_each(|f| *f /= factor),
            Some(RopeScaling::FreqFactors(ff)) => {
                if ff.len() != half {
                    return Err(ModelError::format(format!(
                        "rope_freqs has {} entries, expected {half}",
                        ff.len()
                    )));
                }
                inv.iter_mut().zip(ff).for_each(|(f, d)| *f /= d);
            }
            Some(&RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let old = original_max_position_embeddings as f32;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                for f in inv.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    let scaled = if wavelen > low_wavelen {
                        *f / factor
                    } else {
                        *f
                    };
                    let medium = (high_wavelen..=low_wavelen).contains(&wavelen);
                    *f = if medium {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
        }
        Ok(inv)
    }

    pub fn new(
        theta: f32,
        rotary_dim: usize,
        max_positions: usize,
        scaling: Option<&RopeScaling>,
    ) -> Result<Self, ModelError> {
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
            return Err(ModelError::format(format!(
                "rotary dimension {rotary_dim} must be even and non-zero"
            )));
        }
        let inv = Self::inv_freq(theta, rotary_dim, scaling)?;
        let half = rotary_dim / 2;
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for &f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Ok(RopeTable {
            half,
            max_positions,
            cos,
            sin,
        })
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Rotates each head (`head_dim` wide) of each row of `x` (`[positions.len(), heads * head_dim]`)
    /// by its row's position.
    pub fn apply(&self, x: &mut [f32], positions: &[usize], head_dim: usize) {
        rope_rows(x, positions, head_dim, self.half, &self.cos, &self.sin);
    }
}

isa_variants! {
    /// [`RopeTable::apply`] with the table's half width `h` and its `cos`/`sin` rows.
    fn rope_rows(
        x: &mut [f32],
        positions: &[usize],
        head_dim: usize,
        h: usize,
        cos: &[f32],
        sin: &[f32],
    ) {
        debug_assert!(2 * h <= head_dim);
        let row_len = x.len() / positions.len().max(1);
        for (row, &p) in x.chunks_exact_mut(row_len).zip(positions) {
            let cos = &cos[p * h..(p + 1) * h];
            let sin = &sin[p * h..(p + 1) * h];
            for head in row.chunks_exact_mut(head_dim) {
                let (a, b) = head[..2 * h].split_at_mut(h);
                for i in 0..h {
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * cos[i] - x2 * sin[i];
                    b[i] = x2 * cos[i] + x1 * sin[i];
                }
            }
        }
    }
}

/// SIMD helpers shared by the kernels' x86 variants (`crate::cpu`): inlined into code that
/// runs only on CPUs with the instructions each names.
#[cfg(target_arch = "x86_64")]
pub(crate) mod simd {
    use std::arch::x86_64::*;

    /// The 8 lanes of `v` summed by one fixed tree: lane `i` + lane `i + 4`, then `+ 2`, `+ 1`.
    ///
    /// # Safety
    /// The CPU has AVX.
    #[inline(always)]
    pub(crate) unsafe fn reduce8(v: __m256) -> f32 {
        // SAFETY: register operations; the CPU has AVX (the caller's contract).
        unsafe {
            let v4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
            let v1 = _mm_add_ss(v2, _mm_movehdup_ps(v2));
            _mm_cvtss_f32(v1)
        }
    }

    /// `out[t]` = the 16 lanes of `v[t]` summed by one fixed tree: lane `i` + lane `i + 8`,
    /// then `+ 4`, `+ 2`, `+ 1`, done for all 16 vectors together by transposing adds.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline(always)]
    pub(crate) unsafe fn reduce16(v: &[__m512; 16], out: &mut [f32; 16]) {
        // SAFETY: register operations and one 16-f32 store into `out`; the CPU has AVX-512F
        // (the caller's contract).
        unsafe {
            // a_i: lanes 0..8 = v[2i] halves added, lanes 8..16 = v[2i+1] halves added
            let a: [__m512; 8] = std::array::from_fn(|i| {
                let (x, y) = (v[2 * i], v[2 * i + 1]);
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0x44>(x, y),
                    _mm512_shuffle_f32x4::<0xEE>(x, y),
                )
            });
            // b_i: 128-bit quarter q holds vector 4i + q (lanes i + 4 added in)
            let b: [__m512; 4] = std::array::from_fn(|i| {
                let (x, y) = (a[2 * i], a[2 * i + 1]);
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0x88>(x, y),
                    _mm512_shuffle_f32x4::<0xDD>(x, y),
                )
            });
            // c0 quarter q: [v q, v 4+q, v q, v 4+q] (lanes i + 2 added), c1 for 8+q, 12+q
            let c0 = _mm512_add_ps(
                _mm512_unpacklo_ps(b[0], b[1]),
                _mm512_unpackhi_ps(b[0], b[1]),
            );
            let c1 = _mm512_add_ps(
                _mm512_unpacklo_ps(b[2], b[3]),
                _mm512_unpackhi_ps(b[2], b[3]),
            );
            // quarter q: vectors [q, 8+q, 4+q, 12+q], fully summed
            let z = _mm512_add_ps(_mm512_unpacklo_ps(c0, c1), _mm512_unpackhi_ps(c0, c1));
            let idx = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
            _mm512_storeu_ps(out.as_mut_ptr(), _mm512_permutexvar_ps(idx, z));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn every_variant_of_the_element_wise_ops_gives_the_portable_bits() {
        use crate::cpu::{on_this_thread, Isa};
        let mut s = 3;
        let (d, rows) = (576, 5);
        let x: Vec<f32> = (0..rows * d).map(|_| lcg(&mut s) * 4.0).collect();
        let w: Vec<f32> = (0..d).map(|_| lcg(&mut s)).collect();
        let rope = RopeTable::new(10000.0, 64, 64, None).unwrap();
        let positions: Vec<usize> = (0..rows).map(|r| r * 7 % 64).collect();
        let run = || {
            let mut a = x.clone();
            rms_norm(&mut a, &w, 1e-5);
            add_assign(&mut a, &x);
            let act = silu_mul(&a[..4 * d], 2 * d / 3);
            let mut r = x[..3 * 256].to_vec();
            rotate_blocks(&mut r);
            let mut u = r.clone();
            unrotate_blocks(&mut u);
            let mut q = x.clone();
            rope.apply(&mut q, &positions, 64);
            [a, act, r, u, q].map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        };
        let want = on_this_thread(Isa::Portable, run);
        for isa in Isa::runnable() {
            assert_eq!(on_this_thread(isa, run), want, "{isa:?}");
        }
    }

    #[test]
    fn rms_norm_matches_naive_f64() {
        let mut s = 1;
        let d = 576;
        let x: Vec<f32> = (0..3 * d).map(|_| lcg(&mut s) * 3.0).collect();
        let w: Vec<f32> = (0..d).map(|_| lcg(&mut s)).collect();
        let got = rms_norm_to(&x, &w, 1e-5);
        for r in 0..3 {
            let row = &x[r * d..(r + 1) * d];
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
            let inv = 1.0 / (ms + 1e-5).sqrt();
            for i in 0..d {
                let want = w[i] as f64 * row[i] as f64 * inv;
                assert!(
                    (got[r * d + i] as f64 - want).abs() < 1e-5,
                    "row {r} col {i}"
                );
            }
        }
    }

    #[test]
    fn dot_matches_naive_on_odd_lengths() {
        let mut s = 7;
        for n in [1, 15, 16, 17, 64, 100] {
            let a: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
            let b: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "n={n}");
        }
    }

    /// RoPE against a naive complex-rotation reference: pair (i, i + d/2) rotated by
    /// `pos * theta^(-2i/d)`.
    #[test]
    fn rope_matches_naive_rotation() {
        let (theta, hd, heads) = (100000.0f32, 64, 3);
        let table = RopeTable::new(theta, hd, 512, None).unwrap();
        let mut s = 3;
        let positions = [0usize, 1, 7, 511];
        let x: Vec<f32> = (0..positions.len() * heads * hd)
            .map(|_| lcg(&mut s))
            .collect();
        let mut got = x.clone();
        table.apply(&mut got, &positions, hd);
        for (r, &p) in positions.iter().enumerate() {
            for h in 0..heads {
                let base = (r * heads + h) * hd;
                for i in 0..hd / 2 {
                    let ang = p as f64 * (theta as f64).powf(-((2 * i) as f64) / hd as f64);
                    let (x1, x2) = (x[base + i] as f64, x[base + i + hd / 2] as f64);
                    let w1 = x1 * ang.cos() - x2 * ang.sin();
                    let w2 = x2 * ang.cos() + x1 * ang.sin();
                    // f32 angles at position 511 carry ~3e-5 absolute error
                    assert!((got[base + i] as f64 - w1).abs() < 2e-4, "pos {p} i {i}");
                    assert!((got[base + i + hd / 2] as f64 - w2).abs() < 2e-4);
                }
            }
        }
        // position 0 is the identity
        assert_eq!(&got[..heads * hd], &x[..heads * hd]);
    }

    #[test]
    fn rope_preserves_dot_products_of_equal_shifts() {
        // <R(p)q, R(p')k> depends only on p - p'
        let table = RopeTable::new(10000.0, 8, 64, None).unwrap();
        let q = [0.3f32, -1.0, 0.5, 0.25, 1.0, 0.1, -0.2, 0.7];
        let k = [1.0f32, 0.5, -0.5, 0.1, 0.2, 0.3, 0.9, -0.4];
        let score = |pq: usize, pk: usize| {
            let (mut a, mut b) = (q.to_vec(), k.to_vec());
            table.apply(&mut a, &[pq], 8);
            table.apply(&mut b, &[pk], 8);
            dot(&a, &b)
        };
        assert!((score(5, 2) - score(40, 37)).abs() < 1e-4);
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let sc = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = RopeTable::inv_freq(500000.0, 128, None).unwrap();
        let scaled = RopeTable::inv_freq(500000.0, 128, Some(&sc)).unwrap();
        assert_eq!(plain[0], scaled[0]);
        assert!((plain[63] / 8.0 - scaled[63]).abs() < 1e-12);
        assert!(scaled.iter().zip(&plain).all(|(s, p)| s <= p));
    }

    #[test]
    fn block_rotation_is_orthogonal() {
        let mut s = 5;
        let x: Vec<f32> = (0..512).map(|_| lcg(&mut s)).collect();
        let w: Vec<f32> = (0..512).map(|_| lcg(&mut s)).collect();
        let (mut xr, mut wr) = (x.clone(), w.clone());
        rotate_blocks(&mut xr);
        rotate_blocks(&mut wr);
        // dot products (and norms) are preserved per block, and unrotate inverts rotate
        for i in 0..2 {
            let r = i * 256..(i + 1) * 256;
            assert!((dot(&x[r.clone()], &w[r.clone()]) - dot(&xr[r.clone()], &wr[r])).abs() < 1e-4);
        }
        unrotate_blocks(&mut xr);
        for (a, b) in x.iter().zip(&xr) {
            assert!((a - b).abs() < 1e-5);
        }
        // the fast transform equals the definition H[j][l] = (-1)^popcount(j & l) / 16
        let mut e = x[..256].to_vec();
        hadamard_blocks(&mut e, h16());
        for (l, &got) in e.iter().enumerate() {
            let want: f64 = (0..256)
                .map(|j: usize| {
                    let sgn = if (j & l).count_ones().is_multiple_of(2) {
                        1.0
                    } else {
                        -1.0
                    };
                    sgn * x[j] as f64 / 16.0
                })
                .sum();
            assert!((got as f64 - want).abs() < 1e-5, "{l}");
        }
    }

    #[test]
    fn exp_fast_is_accurate() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            worst = worst.max(((exp_fast(x) as f64 - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 2e-7, "{worst}");
        assert_eq!(exp_fast(0.0), 1.0);
        assert!(exp_fast(-1000.0) < 1e-37);
        let mut v = [0.0f32, -1.0, -2.0];
        let sum = exp_sub_sum(&mut v, 0.0);
        assert!((sum - (1.0 + (-1f32).exp() + (-2f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn silu_mul_matches_definition() {
        let gu = [1.0f32, -2.0, 3.0, 4.0];
        let out = silu_mul(&gu, 2);
        let silu = |x: f32| x / (1.0 + (-x).exp());
        let want = [silu(1.0) * 3.0, silu(-2.0) * 4.0];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() <= 1e-6 * w.abs(), "{o} vs {w}");
        }
    }
}
