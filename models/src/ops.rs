//! The element-wise building blocks of a transformer layer, on row-major f32 slices.
//!
//! - [`rms_norm`]: `w * (x / sqrt(mean(x²) + eps))`, per row, in the order HF transformers uses.
//! - [`RopeTable`]: rotary embeddings in the "rotate half" (GPT-NeoX / HF) convention, with the
//!   model's theta and optional scaling (linear, llama3, per-frequency factors from GGUF);
//!   cos/sin precomputed for every position up to the model's maximum.
//! - [`silu_mul`]: SwiGLU's `silu(gate) * up`.
//! - [`dot`] / [`axpy`]: small vector kernels written so the compiler vectorizes them.
//!
//! Invariant: every function here is deterministic and independent of how rows are batched,
//! so a token's result never depends on the other tokens of the step.

use crate::error::ModelError;

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

/// RMSNorm of each row of `x` into a new buffer.
pub fn rms_norm_to(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rms_norm(&mut out, w, eps);
    out
}

/// `gate_up` holds rows `[gate (n), up (n)]`; returns rows of `silu(gate) * up` (`n` wide).
pub fn silu_mul(gate_up: &[f32], n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(gate_up.len() / 2);
    for row in gate_up.chunks_exact(2 * n) {
        let (g, u) = row.split_at(n);
        out.extend(g.iter().zip(u).map(|(&g, &u)| (g / (1.0 + (-g).exp())) * u));
    }
    out
}

/// `x += y`, element-wise.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

const LANES: usize = 16;

/// Dot product with independent lanes (vectorizes; the summation order is fixed).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    // pairwise reduction of the lanes
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0] + tail
}

/// `y = y * scale + a * x`.
#[inline]
pub fn scale_axpy(y: &mut [f32], scale: f32, a: f32, x: &[f32]) {
    for (yv, &xv) in y.iter_mut().zip(x) {
        *yv = *yv * scale + a * xv;
    }
}

/// `y += a * x`.
#[inline]
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
        let h = self.half;
        debug_assert!(2 * h <= head_dim);
        let row_len = x.len() / positions.len().max(1);
        for (row, &p) in x.chunks_exact_mut(row_len).zip(positions) {
            let cos = &self.cos[p * h..(p + 1) * h];
            let sin = &self.sin[p * h..(p + 1) * h];
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
    fn silu_mul_matches_definition() {
        let gu = [1.0f32, -2.0, 3.0, 4.0];
        let out = silu_mul(&gu, 2);
        let silu = |x: f32| x / (1.0 + (-x).exp());
        assert_eq!(out, vec![silu(1.0) * 3.0, silu(-2.0) * 4.0]);
    }
}
