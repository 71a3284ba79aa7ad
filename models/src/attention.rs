//! Paged attention on the CPU: each query attends to its sequence's K and V read in place from
//! the paged cache through the sequence's block table.
//!
//! - Causal within the sequence: the query at cache index `i` sees cache indices `0..=i`
//!   (or the last `window` of them for sliding-window layers).
//! - GQA without copies: query heads `g*G..(g+1)*G` share KV head `g`; the cache is walked block
//!   by block and each block's rows of every KV head serve that head's queries while hot.
//! - Scores: one kernel for every query, so a query's summation order never depends on the
//!   batch. The whole tile is compiled per instruction set (`crate::cpu`): the AVX-512 variant
//!   scores 16 keys at a time with FMAs, the AVX2 variant 8 (their sums differ from the
//!   portable dot's in the last bits; each key's sum takes the same tree in any slot, so the
//!   block size still changes no bit).
//! - Online softmax over 16 cache positions at a time (running max and sum), so no buffer grows
//!   with the context and no gather copy of the context is made. The 16 are fixed positions
//!   (`16c..16c + 16`), not blocks: the block size never changes a bit of the output, so a P/D
//!   consumer whose blocks differ from its producer's answers as a single instance does. f32
//!   caches are read in place; f16/bf16 caches are decoded 16 rows of one head at a time into a
//!   small scratch, by the variant's vector code (F16C's conversion, bf16's shift).
//! - Work is split into (sequence, tile of queries) tasks, all heads inside (or, when there are
//!   fewer than two tasks per thread, as in a batch-1 decode, a range of KV heads each), run in
//!   parallel on candle's thread pool (the one its matmuls use: a second pool on the same cores only adds
//!   wake-ups and preemption). A query's result depends only on its own sequence's cache,
//!   never on the other tasks, so batching does not change it.

use std::sync::OnceLock;

use tandem_kv_cache::{CacheDtype, LayerKv};

use crate::cpu::Isa;
use crate::error::ModelError;
use crate::model::SeqBatch;
use crate::ops::{axpy, dot, exp_fast, exp_sub_sum};

/// Shape of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplier of `q·k` (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Sliding window (tokens a query sees, itself included); `None` for full attention.
    pub window: Option<usize>,
    /// The KV cache group of the layer: which of a sequence's block tables it reads.
    pub kv_group: usize,
}

/// One layer's cache as the attention reads it (block by block: see [`LayerKv`]).
#[derive(Debug, Clone, Copy)]
pub enum LayerCache<'a> {
    /// f32 K and V (the fast path: a block's rows read in place).
    F32(LayerKv<'a>),
    /// Any dtype, decoded row by row.
    Bytes(LayerKv<'a>),
}

impl<'a> LayerCache<'a> {
    pub fn from_storage(
        kv: &'a tandem_kv_cache::KvStorage,
        layer: usize,
    ) -> Result<Self, ModelError> {
        let view = kv.layer(layer)?;
        // the fast path walks a block's rows of one head at a fixed stride: unsplit blocks only
        let unsplit = view.layout.kernel_block_size == view.layout.block_size;
        Ok(if unsplit && view.layout.dtype == CacheDtype::F32 {
            LayerCache::F32(view)
        } else {
            LayerCache::Bytes(view)
        })
    }
    fn view(&self) -> &LayerKv<'a> {
        match self {
            LayerCache::F32(view) | LayerCache::Bytes(view) => view,
        }
    }
}

/// One task: queries `r0..r0 + n` of sequence `seq`, for the query heads `heads` (a range that
/// may start or end inside a KV head's group).
#[derive(Debug, Clone, PartialEq)]
struct Task {
    seq: usize,
    r0: usize,
    n: usize,
    heads: std::ops::Range<usize>,
}

/// Splits tasks across query heads when there are too few to keep `threads` busy (a batch-1
/// decode step is one task): at least two tasks per thread where the heads allow. The parts
/// are ranges of query heads, not of KV heads, so that 3 KV heads still split evenly over 2
/// threads (a KV head's group may be cut: its K and V rows are then read by both parts). Each
/// query head is computed on its own, so a query's result does not depend on the split.
fn split_by_heads(tasks: Vec<Task>, nh: usize, threads: usize) -> Vec<Task> {
    let want = 2 * threads;
    if threads < 2 || tasks.len() >= want || nh < 2 {
        return tasks;
    }
    let parts = want.div_ceil(tasks.len()).min(nh);
    tasks
        .into_iter()
        .flat_map(|t| {
            (0..parts).map(move |i| Task {
                heads: i * nh / parts..(i + 1) * nh / parts,
                ..t.clone()
            })
        })
        .collect()
}

/// Queries per task: small enough to spread a long prefill over the cores, large enough to
/// reuse each K/V block for many queries.
const QUERY_TILE: usize = 16;

/// Attention output `[q_rows, num_heads * head_dim]` for queries `q` (same shape, RoPE applied)
/// of the sequences `seqs`, reading K and V from `cache`. Rows not covered by a sequence are 0.
pub fn paged_attention(
    q: &[f32],
    seqs: &[SeqBatch],
    cache: LayerCache,
    p: &AttentionParams,
) -> Result<Vec<f32>, ModelError> {
    paged_attention_on(Isa::active(), q, seqs, cache, p)
}

/// [`paged_attention`] with the kernels compiled for `isa`, which this CPU must run.
pub(crate) fn paged_attention_on(
    isa: Isa,
    q: &[f32],
    seqs: &[SeqBatch],
    cache: LayerCache,
    p: &AttentionParams,
) -> Result<Vec<f32>, ModelError> {
    assert!(
        isa.supported(),
        "{} kernels on a CPU without them",
        isa.name()
    );
    let layout = cache.view().layout;
    let (nh, nkv, hd) = (p.num_heads, p.num_kv_heads, p.head_dim);
    if nkv == 0 || nh % nkv != 0 || layout.num_kv_heads != nkv || layout.head_dim != hd {
        return Err(ModelError::InvalidBatch(format!(
            "attention with {nh} heads / {nkv} KV heads of {hd} over a cache of {} KV heads of {}",
            layout.num_kv_heads, layout.head_dim
        )));
    }
    let row = nh * hd;
    let rows = q.len() / row;
    let mut tasks = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        let needed = seq.context_len.div_ceil(layout.block_size);
        // The first cache position any of the sequence's queries sees: a sliding group's
        // table may be null before it.
        let first_seen = p.window.map_or(0, |w| {
            (seq.context_len - seq.query_len.min(seq.context_len) + 1).saturating_sub(w)
        });
        let table = seq.table(p.kv_group);
        if seq.query_len > seq.context_len
            || seq.query_start + seq.query_len > rows
            || table.len() < needed
            || table[first_seen / layout.block_size..needed]
                .iter()
                .any(|&b| b as usize >= layout.num_blocks)
        {
            return Err(ModelError::InvalidBatch(format!(
                "sequence {s} does not fit the batch or the cache of {} blocks",
                layout.num_blocks
            )));
        }
        let mut r = 0;
        while r < seq.query_len {
            let n = (seq.query_len - r).min(QUERY_TILE);
            tasks.push(Task {
                seq: s,
                r0: r,
                n,
                heads: 0..nh,
            });
            r += n;
        }
    }
    // One pool for everything: candle's matmuls run on its barrier pool, so attention does
    // too (a second pool on the same cores only adds wake-ups and preemption). Its threads are
    // its workers and the calling thread.
    let pool = candle_core::utils::barrier_pool();
    let tasks = split_by_heads(tasks, nh, pool.n_workers() + 1);
    let slots: Vec<OnceLock<Vec<f32>>> = (0..tasks.len()).map(|_| OnceLock::new()).collect();
    pool.execute_chunked(tasks.len(), |range| {
        for t in range {
            let _ = slots[t].set(attend_on(isa, q, &seqs[tasks[t].seq], &tasks[t], &cache, p));
        }
    });
    let mut out = vec![0f32; rows * row];
    for (task, res) in tasks.iter().zip(slots) {
        let res = res.into_inner().expect("every task ran");
        let width = task.heads.len() * hd;
        for (i, part) in res.chunks_exact(width).enumerate() {
            let dst = (seqs[task.seq].query_start + task.r0 + i) * row + task.heads.start * hd;
            out[dst..dst + width].copy_from_slice(part);
        }
    }
    Ok(out)
}

/// SIMD width the kernels below are written for (one AVX-512 register of f32).
const L: usize = 16;

/// Keys per online-softmax step, at fixed cache positions (`16c..16c + 16`) whatever the block
/// size: the running max and sum are rescaled at the same places for every block size, so a
/// cache of 32-token blocks gives the bits a cache of 16-token blocks gives (a P/D consumer
/// with another block size than its producer answers what a single instance answers).
const CHUNK: usize = 16;

/// Consecutive keys `j..j + nt` of one KV head: key `j + t`'s row is `k[t * stride..][..hd]`,
/// its value row `v[t * stride..][..hd]`.
struct Segment<'s> {
    j: usize,
    nt: usize,
    k: &'s [f32],
    v: &'s [f32],
    stride: usize,
}

/// How a tile scores a query against a segment's keys: `sc[t] = q · k_t` for the `nt` keys
/// `k_t = kb[t * stride..][..q.len()]` (each key's score on its own: exactly `nt` written).
trait Scores {
    /// # Safety
    /// The CPU runs the implementation's instruction set.
    unsafe fn scores(q: &[f32], kb: &[f32], stride: usize, nt: usize, sc: &mut [f32]);

    /// `acc += Σ_t w[t] · v_t` (see [`accumulate_values`]): multiply-adds rounded twice, the
    /// portable way (a target without FMA has no fast fused one).
    #[inline(always)]
    fn accumulate(acc: &mut [f32], w: &[f32], vb: &[f32], stride: usize) {
        accumulate_values::<false>(acc, w, vb, stride)
    }

    /// One cache row of `dt` as f32: the values [`CacheDtype::decode`] gives (a NaN may keep
    /// another payload).
    ///
    /// # Safety
    /// The CPU runs the implementation's instruction set.
    #[inline(always)]
    unsafe fn decode(dt: CacheDtype, src: &[u8], dst: &mut [f32]) {
        decode_row(dt, src, dst)
    }
}

/// [`Scores::decode`] in plain Rust: bf16 is the top half of an f32 (a shift, which the
/// compiler vectorizes); f16 through `half`.
#[inline(always)]
fn decode_row(dt: CacheDtype, src: &[u8], dst: &mut [f32]) {
    match dt {
        CacheDtype::Bf16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f32::from_bits(u32::from(u16::from_le_bytes([s[0], s[1]])) << 16);
            }
        }
        dt => dt.decode(src, dst),
    }
}

/// One portable dot per key (the portable and AVX2 variants).
struct DotScores;

impl Scores for DotScores {
    #[inline(always)]
    unsafe fn scores(q: &[f32], kb: &[f32], stride: usize, nt: usize, sc: &mut [f32]) {
        let hd = q.len();
        for (t, x) in sc[..nt].iter_mut().enumerate() {
            *x = dot(q, &kb[t * stride..t * stride + hd]);
        }
    }
}

/// Scores `nt` keys `W` at a time with `kernel` (`out[t] = q · k_t` for up to `W` keys), or
/// with the portable dot when the head size is not a multiple of `W`.
///
/// # Safety
/// The CPU runs `kernel`'s instruction set.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scores_by<const W: usize>(
    q: &[f32],
    kb: &[f32],
    stride: usize,
    nt: usize,
    sc: &mut [f32],
    kernel: impl Fn(&[f32], &[f32], usize, usize, &mut [f32; W]),
) {
    let hd = q.len();
    if !hd.is_multiple_of(W) {
        // SAFETY: the portable dot runs anywhere.
        return unsafe { DotScores::scores(q, kb, stride, nt, sc) };
    }
    let mut t = 0;
    while t < nt {
        let k = (nt - t).min(W);
        let mut out = [0f32; W];
        kernel(
            q,
            &kb[t * stride..(t + k - 1) * stride + hd],
            stride,
            k,
            &mut out,
        );
        sc[t..t + k].copy_from_slice(&out[..k]);
        t += k;
    }
}

/// 16 keys at a time with AVX-512 where the head size allows, dots otherwise.
#[cfg(target_arch = "x86_64")]
struct Avx512Scores;

#[cfg(target_arch = "x86_64")]
impl Scores for Avx512Scores {
    /// Fused multiply-adds (the CPU has FMA).
    #[inline(always)]
    fn accumulate(acc: &mut [f32], w: &[f32], vb: &[f32], stride: usize) {
        accumulate_values::<true>(acc, w, vb, stride)
    }

    #[inline(always)]
    unsafe fn decode(dt: CacheDtype, src: &[u8], dst: &mut [f32]) {
        // SAFETY: the variant's CPU has F16C (the caller's contract).
        unsafe { simd::decode_row_f16c(dt, src, dst) }
    }

    #[inline(always)]
    unsafe fn scores(q: &[f32], kb: &[f32], stride: usize, nt: usize, sc: &mut [f32]) {
        // SAFETY: the CPU has AVX-512F (the caller's contract).
        unsafe {
            scores_by::<L>(q, kb, stride, nt, sc, |q, kb, stride, k, out| {
                simd::scores16(q, kb, stride, k, out)
            })
        }
    }
}

/// 8 keys at a time with AVX2 and FMA where the head size allows, dots otherwise.
#[cfg(target_arch = "x86_64")]
struct Avx2Scores;

#[cfg(target_arch = "x86_64")]
impl Scores for Avx2Scores {
    /// Fused multiply-adds (the CPU has FMA).
    #[inline(always)]
    fn accumulate(acc: &mut [f32], w: &[f32], vb: &[f32], stride: usize) {
        accumulate_values::<true>(acc, w, vb, stride)
    }

    #[inline(always)]
    unsafe fn decode(dt: CacheDtype, src: &[u8], dst: &mut [f32]) {
        // SAFETY: the variant's CPU has F16C (the caller's contract).
        unsafe { simd::decode_row_f16c(dt, src, dst) }
    }

    #[inline(always)]
    unsafe fn scores(q: &[f32], kb: &[f32], stride: usize, nt: usize, sc: &mut [f32]) {
        // SAFETY: the CPU has AVX2 and FMA (the caller's contract).
        unsafe {
            scores_by::<8>(q, kb, stride, nt, sc, |q, kb, stride, k, out| {
                simd::scores8(q, kb, stride, k, out)
            })
        }
    }
}

/// AVX-512 kernels of the AVX-512 variant (inlined into code that runs only on CPUs with
/// AVX-512F) and the AVX2 variant's (on CPUs with AVX2 and FMA).
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// `out[t] = q · k_t` for `nt <= 16` keys `k_t = kb[t * stride..][..q.len()]`, with
    /// `q.len()` a multiple of 16: one 16-lane partial sum per key, then the 16 partial sums
    /// are reduced together by a transpose-and-add tree (15 adds instead of 16 horizontal sums).
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline(always)]
    pub(super) unsafe fn scores16(
        q: &[f32],
        kb: &[f32],
        stride: usize,
        nt: usize,
        out: &mut [f32; 16],
    ) {
        let hd = q.len();
        assert!(nt <= 16 && hd.is_multiple_of(16));
        assert!(nt == 0 || kb.len() >= (nt - 1) * stride + hd);
        // SAFETY: every load reads 16 f32 at `q[c..c + 16]` or `kb[t * stride + c..][..16]`
        // with `c + 16 <= hd`, `t < nt`; both ranges are in bounds by the asserts above. The CPU
        // has AVX-512F (the caller's contract).
        unsafe {
            let mut v = [_mm512_setzero_ps(); 16];
            for (t, vt) in v.iter_mut().enumerate().take(nt) {
                let kp = kb.as_ptr().add(t * stride);
                let mut a = _mm512_setzero_ps();
                for c in (0..hd).step_by(16) {
                    a = _mm512_fmadd_ps(
                        _mm512_loadu_ps(q.as_ptr().add(c)),
                        _mm512_loadu_ps(kp.add(c)),
                        a,
                    );
                }
                *vt = a;
            }
            // the 16 partial sums reduced together (15 adds instead of 16 horizontal sums)
            super::super::ops::simd::reduce16(&v, out);
        }
    }

    /// [`super::decode_row`] with f16 rows converted by F16C ([`f16_row`]).
    ///
    /// # Safety
    /// The CPU has F16C and AVX.
    #[inline(always)]
    pub(super) unsafe fn decode_row_f16c(
        dt: tandem_kv_cache::CacheDtype,
        src: &[u8],
        dst: &mut [f32],
    ) {
        match dt {
            // SAFETY: the caller's contract.
            tandem_kv_cache::CacheDtype::F16 => unsafe { f16_row(src, dst) },
            dt => super::decode_row(dt, src, dst),
        }
    }

    /// An f16 cache row as f32, 8 values per F16C conversion (exact, as `half`'s is).
    ///
    /// # Safety
    /// The CPU has F16C and AVX.
    #[inline(always)]
    pub(super) unsafe fn f16_row(src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), 2 * dst.len());
        let n = dst.len();
        let mut i = 0;
        // SAFETY: 8 f16 at byte 2i and 8 f32 at i, with i + 8 <= n: inside both slices (the
        // assert above); the CPU has F16C (the caller's contract).
        unsafe {
            while i + 8 <= n {
                let h = _mm_loadu_si128(src.as_ptr().add(2 * i).cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
                i += 8;
            }
        }
        tandem_kv_cache::CacheDtype::F16.decode(&src[2 * i..], &mut dst[i..]);
    }

    /// `out[t] = q · k_t` for `nt <= 8` keys `k_t = kb[t * stride..][..q.len()]`, with
    /// `q.len()` a multiple of 8: one 8-lane FMA chain per key, then the 8 partial sums reduced
    /// together by horizontal adds (every key's lanes summed by the same tree, whatever its slot).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[inline(always)]
    pub(super) unsafe fn scores8(
        q: &[f32],
        kb: &[f32],
        stride: usize,
        nt: usize,
        out: &mut [f32; 8],
    ) {
        let hd = q.len();
        assert!(nt <= 8 && hd.is_multiple_of(8));
        assert!(nt == 0 || kb.len() >= (nt - 1) * stride + hd);
        // SAFETY: every load reads 8 f32 at `q[c..c + 8]` or `kb[t * stride + c..][..8]` with
        // `c + 8 <= hd`, `t < nt`; both ranges are in bounds by the asserts above. The CPU has
        // AVX2 and FMA (the caller's contract).
        unsafe {
            let mut v = [_mm256_setzero_ps(); 8];
            for (t, vt) in v.iter_mut().enumerate().take(nt) {
                let kp = kb.as_ptr().add(t * stride);
                let mut a = _mm256_setzero_ps();
                for c in (0..hd).step_by(8) {
                    a = _mm256_fmadd_ps(
                        _mm256_loadu_ps(q.as_ptr().add(c)),
                        _mm256_loadu_ps(kp.add(c)),
                        a,
                    );
                }
                *vt = a;
            }
            // per 128-bit half: [v0 01, v0 23, v1 01, v1 23] and [v0 45, v0 67, v1 45, v1 67]
            let h01 = _mm256_hadd_ps(v[0], v[1]);
            let h23 = _mm256_hadd_ps(v[2], v[3]);
            let h45 = _mm256_hadd_ps(v[4], v[5]);
            let h67 = _mm256_hadd_ps(v[6], v[7]);
            // low half: lanes 0..4 of v0..v3 summed; high half: lanes 4..8
            let a = _mm256_hadd_ps(h01, h23);
            let b = _mm256_hadd_ps(h45, h67);
            let lo = _mm256_permute2f128_ps::<0x20>(a, b);
            let hi = _mm256_permute2f128_ps::<0x31>(a, b);
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(lo, hi));
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn f16_rows_decode_as_the_cache_does() {
            if !crate::cpu::Isa::Avx2.supported() {
                return;
            }
            // every 16-bit pattern once: normals, subnormals, zeros, infinities, NaNs
            let src: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
            for len in [65536, 37, 8, 7, 0] {
                let mut got = vec![0f32; len];
                let mut want = vec![0f32; len];
                // SAFETY: the CPU has AVX2 and F16C (checked above).
                unsafe { super::f16_row(&src[..2 * len], &mut got) };
                tandem_kv_cache::CacheDtype::F16.decode(&src[..2 * len], &mut want);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "f16 {i:#06x}: {g} vs {w}"
                    );
                }
            }
        }

        #[test]
        fn bf16_rows_decode_as_the_cache_does() {
            let src: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
            let mut got = vec![0f32; 65536];
            let mut want = vec![0f32; 65536];
            super::super::decode_row(tandem_kv_cache::CacheDtype::Bf16, &src, &mut got);
            tandem_kv_cache::CacheDtype::Bf16.decode(&src, &mut want);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "bf16 {i:#06x}: {g} vs {w}"
                );
            }
        }

        #[test]
        fn scores8_equals_dots_and_ignores_its_slot() {
            if !crate::cpu::Isa::Avx2.supported() {
                return;
            }
            let hd = 64;
            let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.3).sin()).collect();
            let stride = 3 * hd;
            let kb: Vec<f32> = (0..9 * stride).map(|i| (i as f32 * 0.7).cos()).collect();
            let mut first = [0f32; 8];
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { super::scores8(&q, &kb[..7 * stride + hd], stride, 8, &mut first) };
            for nt in [8, 5, 1] {
                let mut out = [0f32; 8];
                // SAFETY: as above.
                unsafe { super::scores8(&q, &kb[..(nt - 1) * stride + hd], stride, nt, &mut out) };
                for t in 0..nt {
                    let want: f32 = (0..hd).map(|d| q[d] * kb[t * stride + d]).sum();
                    assert!((out[t] - want).abs() < 1e-4, "nt {nt} key {t}");
                    assert_eq!(out[t].to_bits(), first[t].to_bits(), "nt {nt} key {t}");
                }
            }
            // a key scores the same bits in another slot
            let mut shifted = [0f32; 8];
            // SAFETY: as above.
            unsafe { super::scores8(&q, &kb[stride..8 * stride + hd], stride, 8, &mut shifted) };
            assert_eq!(shifted[0].to_bits(), first[1].to_bits());
        }

        #[test]
        fn scores16_equals_dots() {
            if !crate::cpu::Isa::Avx512.supported() {
                return;
            }
            let hd = 64;
            let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.3).sin()).collect();
            let stride = 3 * hd;
            let kb: Vec<f32> = (0..16 * stride).map(|i| (i as f32 * 0.7).cos()).collect();
            for nt in [16, 5, 1] {
                let mut out = [0f32; 16];
                // SAFETY: the CPU has AVX-512 (checked above).
                unsafe { super::scores16(&q, &kb[..(nt - 1) * stride + hd], stride, nt, &mut out) };
                for t in 0..nt {
                    let want: f32 = (0..hd).map(|d| q[d] * kb[t * stride + d]).sum();
                    assert!((out[t] - want).abs() < 1e-4, "nt {nt} key {t}");
                }
            }
        }
    }
}

/// `acc += Σ_t w[t] · v_t` where `v_t = vb[t * stride..][..hd]`: 64 dimensions at a time held in
/// registers across all keys (independent chains), then 16 at a time; each element's
/// multiply-adds in key order, fused (one rounding) with `FUSED`, else a multiply and an add.
#[inline(always)]
fn accumulate_values<const FUSED: bool>(acc: &mut [f32], w: &[f32], vb: &[f32], stride: usize) {
    let madd = |a: f32, w: f32, v: f32| if FUSED { w.mul_add(v, a) } else { a + w * v };
    let hd = acc.len();
    let mut c = 0;
    while c + 4 * L <= hd {
        let mut a: [f32; 4 * L] = acc[c..c + 4 * L].try_into().unwrap();
        for (t, &wt) in w.iter().enumerate() {
            let o = t * stride + c;
            let v: &[f32; 4 * L] = vb[o..o + 4 * L].try_into().unwrap();
            for l in 0..4 * L {
                a[l] = madd(a[l], wt, v[l]);
            }
        }
        acc[c..c + 4 * L].copy_from_slice(&a);
        c += 4 * L;
    }
    while c + L <= hd {
        let mut a: [f32; L] = acc[c..c + L].try_into().unwrap();
        for (t, &wt) in w.iter().enumerate() {
            let o = t * stride + c;
            let v: &[f32; L] = vb[o..o + L].try_into().unwrap();
            for l in 0..L {
                a[l] = madd(a[l], wt, v[l]);
            }
        }
        acc[c..c + L].copy_from_slice(&a);
        c += L;
    }
    if c < hd {
        for (t, &wt) in w.iter().enumerate() {
            let o = t * stride;
            if FUSED {
                for (a, &v) in acc[c..].iter_mut().zip(&vb[o + c..o + hd]) {
                    *a = madd(*a, wt, v);
                }
            } else {
                axpy(&mut acc[c..], wt, &vb[o + c..o + hd]);
            }
        }
    }
}

/// Attention of queries `r0..r0+n` of `seq`, query heads `task.heads`. Returns
/// `[n, task.heads.len() * head_dim]`.
///
/// The cache is walked 16 positions at a time ([`CHUNK`]); their rows of every KV head are used
/// by that head's query vectors while they are hot, so the context is read from memory once.
///
/// # Safety
/// The CPU runs `S`'s instruction set.
#[inline(always)]
unsafe fn attend_tile<S: Scores>(
    q: &[f32],
    seq: &SeqBatch,
    task: &Task,
    cache: &LayerCache,
    p: &AttentionParams,
) -> Vec<f32> {
    let (nh, nkv, hd) = (p.num_heads, p.num_kv_heads, p.head_dim);
    let group = nh / nkv;
    let (r0, n, heads) = (task.r0, task.n, task.heads.clone());
    let layout = cache.view().layout;
    let bs = layout.block_size;
    let first = seq.context_len - seq.query_len; // cache index of the sequence's first query

    // The KV heads the task reads: (KV head g, its query heads in the task, the index of their
    // first vector). Scaled query vectors are ordered [kv head][query i][head of the group in
    // the task], so that the vectors sharing a KV head are contiguous: KV head g's vector of
    // query i and head h is `off + i * hs.len() + (h - hs.start)`.
    let kv_heads: Vec<(usize, std::ops::Range<usize>, usize)> = (heads.start / group
        ..heads.end.div_ceil(group))
        .map(|g| {
            let hs = heads.start.max(g * group)..heads.end.min((g + 1) * group);
            let off = n * (hs.start - heads.start);
            (g, hs, off)
        })
        .collect();
    let nq = n * heads.len();
    let mut qs = vec![0f32; nq * hd];
    for i in 0..n {
        let src = &q[(seq.query_start + r0 + i) * nh * hd..][..nh * hd];
        for (_, hs, off) in &kv_heads {
            let dst = (off + i * hs.len()) * hd;
            for (d, &x) in qs[dst..dst + hs.len() * hd]
                .iter_mut()
                .zip(&src[hs.start * hd..hs.end * hd])
            {
                *d = x * p.scale;
            }
        }
    }
    // Visible cache range of each query: [lo, hi).
    let hi = |i: usize| first + r0 + i + 1;
    let lo = |i: usize| p.window.map_or(0, |w| hi(i).saturating_sub(w));
    let (t_lo, t_hi) = (lo(0), hi(n - 1));
    let table = seq.table(p.kv_group);

    let mut acc = vec![0f32; nq * hd];
    let mut max = vec![f32::NEG_INFINITY; nq];
    let mut sum = vec![0f32; nq];
    // scores of the query vectors of one KV head for the keys of one chunk: [vectors, CHUNK]
    let mut scores = vec![0f32; n * group * CHUNK];
    let bytes = matches!(cache, LayerCache::Bytes(_));
    let mut k_scratch = vec![0f32; if bytes { CHUNK * hd } else { 0 }];
    let mut v_scratch = k_scratch.clone();
    let mut f32_segments: Vec<Segment> = Vec::with_capacity(CHUNK);

    for c in t_lo / CHUNK..t_hi.div_ceil(CHUNK) {
        // keys j0..j1 of this chunk that some query of the tile sees
        let c0 = c * CHUNK;
        let (j0, j1) = (c0.max(t_lo), (c0 + CHUNK).min(t_hi));
        for (g, hs, off) in &kv_heads {
            let (g, off, ng) = (*g, *off, hs.len());
            // The chunk's K and V rows of head g: one segment per block it overlaps (read in
            // place from f32 blocks), or one segment decoded into the scratch.
            f32_segments.clear();
            for (b, &block) in table.iter().enumerate().take(j1.div_ceil(bs)).skip(j0 / bs) {
                let block = block as usize;
                let (s0, s1) = ((b * bs).max(j0), ((b + 1) * bs).min(j1));
                let nt = s1 - s0;
                match cache {
                    LayerCache::F32(view) => {
                        // Only this block is borrowed: the request owns it (others are written
                        // meanwhile by loads and other requests' cache writes).
                        let (k, v) = view
                            .block_f32(block)
                            .ok()
                            .flatten()
                            .expect("blocks were checked by paged_attention; the cache is f32");
                        let start = (view.layout.row_offset(block, s0 - b * bs, g)
                            - block * view.layout.block_bytes())
                            / 4;
                        let stride = row_stride_f32(view);
                        let len = (nt - 1) * stride + hd;
                        f32_segments.push(Segment {
                            j: s0,
                            nt,
                            k: &k[start..start + len],
                            v: &v[start..start + len],
                            stride,
                        });
                    }
                    LayerCache::Bytes(view) => {
                        let dt: CacheDtype = view.layout.dtype;
                        for j in s0..s1 {
                            let (kr, vr) = view.rows(block, j - b * bs, g);
                            let o = (j - j0) * hd;
                            // SAFETY: the caller's contract.
                            unsafe {
                                S::decode(dt, kr, &mut k_scratch[o..o + hd]);
                                S::decode(dt, vr, &mut v_scratch[o..o + hd]);
                            }
                        }
                    }
                }
            }
            let decoded;
            let segments: &[Segment] = if bytes {
                decoded = [Segment {
                    j: j0,
                    nt: j1 - j0,
                    k: &k_scratch,
                    v: &v_scratch,
                    stride: hd,
                }];
                &decoded
            } else {
                &f32_segments
            };
            let qg = &qs[off * hd..(off + n * ng) * hd];
            // Scores of the group's query vectors against all keys of the chunk (masking below).
            // One kernel for every query, whatever the batch, and each key's score on its own:
            // neither the batch nor the block size changes a score.
            for (qv, sc) in qg.chunks_exact(hd).zip(scores.chunks_exact_mut(CHUNK)) {
                for seg in segments {
                    // SAFETY: the caller's contract.
                    unsafe { S::scores(qv, seg.k, seg.stride, seg.nt, &mut sc[seg.j - c0..]) };
                }
            }
            // Online softmax update and weighted sum of V, per query vector.
            for i in 0..n {
                let (a, z) = (lo(i).max(j0), hi(i).min(j1));
                if a >= z {
                    continue;
                }
                for h in 0..ng {
                    let li = i * ng + h; // within the KV head's vectors
                    let qi = off + li;
                    let row = &mut scores[li * CHUNK..(li + 1) * CHUNK];
                    let sc = &mut row[a - c0..z - c0];
                    let m_blk = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let acc_q = &mut acc[qi * hd..(qi + 1) * hd];
                    if m_blk > max[qi] {
                        let c = exp_fast(max[qi] - m_blk); // 0 on the first chunk
                        sum[qi] *= c;
                        acc_q.iter_mut().for_each(|x| *x *= c);
                        max[qi] = m_blk;
                    }
                    sum[qi] += exp_sub_sum(sc, max[qi]);
                    // V rows in key order, segment by segment: each output element sees the
                    // same sequence of multiply-adds whatever the segments are.
                    for seg in segments {
                        let (sa, sz) = (a.max(seg.j), z.min(seg.j + seg.nt));
                        if sa < sz {
                            S::accumulate(
                                acc_q,
                                &row[sa - c0..sz - c0],
                                &seg.v[(sa - seg.j) * seg.stride..],
                                seg.stride,
                            );
                        }
                    }
                }
            }
        }
    }
    // Normalize and reorder to [query i][head of this task].
    let mut out = vec![0f32; nq * hd];
    for (_, hs, off) in &kv_heads {
        for i in 0..n {
            for (h, head) in hs.clone().enumerate() {
                let qi = off + i * hs.len() + h;
                let inv = 1.0 / sum[qi];
                let dst = (i * heads.len() + head - heads.start) * hd;
                for (o, &a) in out[dst..dst + hd]
                    .iter_mut()
                    .zip(&acc[qi * hd..(qi + 1) * hd])
                {
                    *o = a * inv;
                }
            }
        }
    }
    out
}

/// [`attend_tile`] compiled for `isa`, which this CPU runs (asserted by the caller).
fn attend_on(
    isa: Isa,
    q: &[f32],
    seq: &SeqBatch,
    task: &Task,
    cache: &LayerCache,
    p: &AttentionParams,
) -> Vec<f32> {
    // SAFETY: each variant is entered only for its own `isa`, which the CPU runs.
    unsafe {
        match isa {
            Isa::Portable => attend_tile::<DotScores>(q, seq, task, cache, p),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => attend_avx2(q, seq, task, cache, p),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => attend_avx512(q, seq, task, cache, p),
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("{} is never supported off x86-64", isa.name()),
        }
    }
}

/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(
    q: &[f32],
    seq: &SeqBatch,
    task: &Task,
    cache: &LayerCache,
    p: &AttentionParams,
) -> Vec<f32> {
    // SAFETY: the caller's contract.
    unsafe { attend_tile::<Avx2Scores>(q, seq, task, cache, p) }
}

/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn attend_avx512(
    q: &[f32],
    seq: &SeqBatch,
    task: &Task,
    cache: &LayerCache,
    p: &AttentionParams,
) -> Vec<f32> {
    // SAFETY: the caller's contract.
    unsafe { attend_tile::<Avx512Scores>(q, seq, task, cache, p) }
}

/// Distance in f32 elements between the rows of consecutive tokens of one head.
fn row_stride_f32(view: &LayerKv) -> usize {
    let l = view.layout;
    (l.row_offset(0, 1 % l.block_size, 0) - l.row_offset(0, 0, 0)) / 4
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_cache::{KvCacheConfig, KvCacheGroup, KvCacheSpec, KvStorage};

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    struct Case {
        /// (cached tokens before the step, new tokens)
        seqs: Vec<(usize, usize)>,
        block_size: usize,
        nh: usize,
        nkv: usize,
        hd: usize,
        window: Option<usize>,
    }

    /// Builds a cache with scrambled block tables, fills every sequence's K/V (old and new
    /// tokens), and compares paged attention with a dense reference computed in f64.
    fn check(case: &Case, dtype: CacheDtype, seed: u64) {
        let mut s = seed;
        let (bs, nh, nkv, hd) = (case.block_size, case.nh, case.nkv, case.hd);
        let blocks_needed: usize = case.seqs.iter().map(|&(c, n)| (c + n).div_ceil(bs)).sum();
        let num_blocks = blocks_needed + 5;
        let storage = one_layer_storage(num_blocks, bs, nkv, hd, dtype);
        // scrambled block ids: a stride permutation of 0..num_blocks
        let mut ids: Vec<u32> = (0..num_blocks as u32)
            .map(|i| (i * 7 + 3) % num_blocks as u32)
            .collect();
        assert!(!num_blocks.is_multiple_of(7));
        let mut tables = Vec::new();
        let mut dense_k = Vec::new();
        let mut dense_v = Vec::new();
        for &(c, n) in &case.seqs {
            let nb = (c + n).div_ceil(bs);
            let table: Vec<u32> = ids.drain(..nb).collect();
            let total = c + n;
            let k: Vec<f32> = (0..total * nkv * hd).map(|_| lcg(&mut s)).collect();
            let v: Vec<f32> = (0..total * nkv * hd).map(|_| lcg(&mut s)).collect();
            let slots: Vec<usize> = (0..total)
                .map(|j| table[j / bs] as usize * bs + j % bs)
                .collect();
            storage.write_slots(0, &slots, &k, &v).unwrap();
            // the dense reference sees what the cache holds (rounded to its dtype)
            let round = |x: &[f32]| {
                let mut bytes = vec![0u8; x.len() * dtype.size()];
                dtype.encode(x, &mut bytes);
                let mut back = vec![0f32; x.len()];
                dtype.decode(&bytes, &mut back);
                back
            };
            dense_k.push(round(&k));
            dense_v.push(round(&v));
            tables.push(table);
        }
        let mut seq_batches = Vec::new();
        let mut start = 0;
        for (i, &(c, n)) in case.seqs.iter().enumerate() {
            seq_batches.push(SeqBatch {
                query_start: start,
                query_len: n,
                context_len: c + n,
                block_tables: std::slice::from_ref(&tables[i]),
            });
            start += n;
        }
        let rows = start;
        let q: Vec<f32> = (0..rows * nh * hd).map(|_| lcg(&mut s) * 2.0).collect();
        let p = AttentionParams {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window: case.window,
            kv_group: 0,
        };
        let cache = LayerCache::from_storage(&storage, 0).unwrap();
        let run = |isa| paged_attention_on(isa, &q, &seq_batches, cache, &p).unwrap();
        // every variant this CPU runs (AVX2 and AVX-512 sum the scores in other orders than
        // the portable dot): each against the reference below
        for isa in Isa::runnable() {
            let other = run(isa);
            check_dense(
                case,
                dtype,
                &q,
                &seq_batches,
                &dense_k,
                &dense_v,
                &p,
                &other,
            );
        }
    }

    /// Compares `got` with attention computed densely in f64.
    #[allow(clippy::too_many_arguments)]
    fn check_dense(
        case: &Case,
        dtype: CacheDtype,
        q: &[f32],
        seq_batches: &[SeqBatch],
        dense_k: &[Vec<f32>],
        dense_v: &[Vec<f32>],
        p: &AttentionParams,
        got: &[f32],
    ) {
        let (nh, nkv, hd) = (case.nh, case.nkv, case.hd);
        // dense reference
        let group = nh / nkv;
        for (si, &(c, n)) in case.seqs.iter().enumerate() {
            let (k, v) = (&dense_k[si], &dense_v[si]);
            for i in 0..n {
                let row = seq_batches[si].query_start + i;
                let last = c + i;
                let lo = case.window.map_or(0, |w| (last + 1).saturating_sub(w));
                for h in 0..nh {
                    let kvh = h / group;
                    let qv = &q[(row * nh + h) * hd..(row * nh + h + 1) * hd];
                    let sc: Vec<f64> = (lo..=last)
                        .map(|j| {
                            let kr = &k[(j * nkv + kvh) * hd..(j * nkv + kvh + 1) * hd];
                            qv.iter()
                                .zip(kr)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                * p.scale as f64
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for d in 0..hd {
                        let want: f64 = (lo..=last)
                            .zip(&e)
                            .map(|(j, w)| w * v[(j * nkv + kvh) * hd + d] as f64)
                            .sum::<f64>()
                            / z;
                        let g = got[(row * nh + h) * hd + d] as f64;
                        assert!(
                            (g - want).abs() < 1e-4,
                            "{dtype} seq {si} query {i} head {h} dim {d}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn paged_matches_dense_for_mixed_prefill_and_decode() {
        let case = Case {
            // prefill from scratch (partial last block), decode, chunked prefill over a cached
            // prefix, a long prefill spanning several query tiles
            seqs: vec![(0, 5), (37, 1), (16, 9), (0, 40), (3, 1)],
            block_size: 16,
            nh: 6,
            nkv: 2,
            hd: 64,
            window: None,
        };
        for dt in [CacheDtype::F32, CacheDtype::F16, CacheDtype::Bf16] {
            check(&case, dt, 11);
        }
    }

    #[test]
    fn paged_matches_dense_with_tiny_blocks_mha_and_window() {
        let case = Case {
            seqs: vec![(10, 3), (0, 7), (1, 1)],
            block_size: 4,
            nh: 3,
            nkv: 3,
            hd: 8,
            window: None,
        };
        check(&case, CacheDtype::F32, 5);
        let case = Case {
            window: Some(5),
            block_size: 2,
            nh: 4,
            nkv: 1,
            ..case
        };
        check(&case, CacheDtype::F32, 6);
        check(&case, CacheDtype::Bf16, 7);
    }

    #[test]
    fn a_query_does_not_depend_on_the_rest_of_the_batch() {
        // the same sequence alone and behind another one gives bit-identical output
        let storage = one_layer_storage(8, 4, 1, 16, CacheDtype::F32);
        let mut s = 9;
        let kv: Vec<f32> = (0..32 * 16).map(|_| lcg(&mut s)).collect();
        let slots: Vec<usize> = (0..32).collect();
        storage.write_slots(0, &slots, &kv, &kv).unwrap();
        let q: Vec<f32> = (0..3 * 2 * 16).map(|_| lcg(&mut s)).collect();
        let p = AttentionParams {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 16,
            scale: 0.25,
            window: None,
            kv_group: 0,
        };
        let (ta, tb) = (vec![0u32, 1, 2], vec![4u32, 5, 6, 7]);
        let a = SeqBatch {
            query_start: 0,
            query_len: 2,
            context_len: 10,
            block_tables: std::slice::from_ref(&ta),
        };
        let b = SeqBatch {
            query_start: 2,
            query_len: 1,
            context_len: 15,
            block_tables: std::slice::from_ref(&tb),
        };
        let cache = LayerCache::from_storage(&storage, 0).unwrap();
        let both = paged_attention(&q, &[a, b], cache, &p).unwrap();
        let b_alone = SeqBatch {
            query_start: 0,
            ..b
        };
        let alone = paged_attention(&q[2 * 32..], &[b_alone], cache, &p).unwrap();
        assert_eq!(&both[2 * 32..], &alone[..]);
    }

    /// A cache of one full-attention layer: `num_blocks` blocks of `block_size` tokens.
    fn one_layer_storage(
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
        dtype: CacheDtype,
    ) -> KvStorage {
        KvStorage::new(&KvCacheConfig {
            num_blocks,
            groups: vec![KvCacheGroup {
                group_id: 0,
                spec: KvCacheSpec::FullAttention {
                    block_size,
                    num_kv_heads,
                    head_dim,
                    dtype,
                },
                layer_names: vec!["layers.0".into()],
            }],
        })
        .unwrap()
    }

    /// Attention of queries over one sequence's K/V held in a cache of `bs`-token blocks
    /// (scrambled block ids), for the ISA `isa`.
    #[allow(clippy::too_many_arguments)]
    fn attend_with_block_size(
        isa: Isa,
        bs: usize,
        dtype: CacheDtype,
        kv: (&[f32], &[f32]),
        q: &[f32],
        (cached, new): (usize, usize),
        p: &AttentionParams,
    ) -> Vec<u32> {
        let total = cached + new;
        let nb = total.div_ceil(bs);
        let num_blocks = nb + 3;
        let storage = one_layer_storage(num_blocks, bs, p.num_kv_heads, p.head_dim, dtype);
        let table: Vec<u32> = (0..nb as u32).map(|i| (nb as u32 - 1 - i) + 2).collect();
        let slots: Vec<usize> = (0..total)
            .map(|j| table[j / bs] as usize * bs + j % bs)
            .collect();
        storage.write_slots(0, &slots, kv.0, kv.1).unwrap();
        let seq = SeqBatch {
            query_start: 0,
            query_len: new,
            context_len: total,
            block_tables: std::slice::from_ref(&table),
        };
        let cache = LayerCache::from_storage(&storage, 0).unwrap();
        paged_attention_on(isa, q, &[seq], cache, p)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    #[test]
    fn the_block_size_does_not_change_a_bit() {
        // the softmax steps over fixed positions, so blocks of 1, 5, 16, 32 or 48 tokens give
        // the same bits: prefills from scratch and over a cached prefix, decodes, a window
        let (nh, nkv, hd) = (6, 2, 32);
        let mut s = 31;
        let total = 75;
        let k: Vec<f32> = (0..total * nkv * hd).map(|_| lcg(&mut s) * 3.0).collect();
        let v: Vec<f32> = (0..total * nkv * hd).map(|_| lcg(&mut s)).collect();
        for (cached, new) in [(0, 75), (40, 35), (74, 1), (20, 1)] {
            let kv = (
                &k[..(cached + new) * nkv * hd],
                &v[..(cached + new) * nkv * hd],
            );
            let q: Vec<f32> = (0..new * nh * hd).map(|_| lcg(&mut s) * 3.0).collect();
            for window in [None, Some(21)] {
                let p = AttentionParams {
                    num_heads: nh,
                    num_kv_heads: nkv,
                    head_dim: hd,
                    scale: 1.0 / (hd as f32).sqrt(),
                    window,
                    kv_group: 0,
                };
                for isa in Isa::runnable() {
                    for dtype in [CacheDtype::F32, CacheDtype::Bf16] {
                        let run =
                            |bs| attend_with_block_size(isa, bs, dtype, kv, &q, (cached, new), &p);
                        let want = run(16);
                        for bs in [1, 5, 32, 48] {
                            assert!(
                                run(bs) == want,
                                "{isa:?} {dtype} blocks of {bs} vs 16: ({cached}, {new}) \
                                 window {window:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn few_tasks_are_split_over_query_heads_covering_each_once() {
        let t = |seq, r0, n| Task {
            seq,
            r0,
            n,
            heads: 0..9,
        };
        // one decode task, two threads, 9 heads (3 KV heads): four parts of 2 or 3 heads, not
        // three of a KV head each (that leaves one thread with two of the three)
        let split = split_by_heads(vec![t(0, 0, 1)], 9, 2);
        let heads: Vec<_> = split.iter().map(|t| t.heads.clone()).collect();
        assert_eq!(heads, vec![0..2, 2..4, 4..6, 6..9]);
        // two tasks, two threads: two parts each, every head once per task
        let split = split_by_heads(vec![t(0, 0, 1), t(1, 0, 4)], 9, 2);
        assert_eq!(split.len(), 4);
        for seq in 0..2 {
            let mut covered: Vec<usize> = split
                .iter()
                .filter(|t| t.seq == seq)
                .flat_map(|t| t.heads.clone())
                .collect();
            covered.sort();
            assert_eq!(covered, (0..9).collect::<Vec<_>>());
        }
        // enough tasks, one thread or one head: unchanged
        let many: Vec<Task> = (0..4).map(|s| t(s, 0, 1)).collect();
        assert_eq!(split_by_heads(many.clone(), 9, 2), many);
        assert_eq!(split_by_heads(vec![t(0, 0, 1)], 9, 1), vec![t(0, 0, 1)]);
        assert_eq!(split_by_heads(vec![t(0, 0, 1)], 1, 2).len(), 1);
    }

    #[test]
    fn a_decode_split_over_heads_equals_the_same_query_in_a_full_batch() {
        // 6 query heads over 3 KV heads: alone, the decode query is one task split over the
        // query heads (on 2+ threads: parts cut through KV heads' groups); behind 5 other
        // sequences nothing is split
        let (nh, nkv, hd, bs) = (6, 3, 16, 4);
        let storage = one_layer_storage(40, bs, nkv, hd, CacheDtype::F32);
        let mut s = 21;
        let kv: Vec<f32> = (0..160 * nkv * hd).map(|_| lcg(&mut s)).collect();
        let slots: Vec<usize> = (0..160).collect();
        storage.write_slots(0, &slots, &kv, &kv).unwrap();
        let q: Vec<f32> = (0..6 * nh * hd).map(|_| lcg(&mut s)).collect();
        let p = AttentionParams {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            scale: 0.25,
            window: None,
            kv_group: 0,
        };
        let tables: Vec<Vec<u32>> = (0..6u32).map(|i| (i * 6..i * 6 + 6).collect()).collect();
        let seq = |i: usize, start: usize| SeqBatch {
            query_start: start,
            query_len: 1,
            context_len: 17 + i,
            block_tables: std::slice::from_ref(&tables[i]),
        };
        let cache = LayerCache::from_storage(&storage, 0).unwrap();
        let batch: Vec<SeqBatch> = (0..6).map(|i| seq(i, i)).collect();
        let row = nh * hd;
        for isa in Isa::runnable() {
            let all = paged_attention_on(isa, &q, &batch, cache, &p).unwrap();
            for i in [0, 5] {
                let alone =
                    paged_attention_on(isa, &q[i * row..(i + 1) * row], &[seq(i, 0)], cache, &p)
                        .unwrap();
                assert_eq!(&all[i * row..(i + 1) * row], &alone[..], "{isa:?} seq {i}");
            }
        }
    }
}
