// Tandem's decoder kernels: everything of a Llama-family forward step on the GPU except the
// matrix products (cuBLAS). Conventions shared with kernels/src/cuda/decoder.rs:
// - the residual stream is f32 [tokens, hidden]; what a matmul reads is bf16;
// - QKV rows are [q heads | k heads | v heads] of head_dim each (HF order, rotate-half RoPE);
// - the paged KV cache is bf16, token-major within a block: token `o` of block `b`, head `h` of a
//   layer starts at base + b * block_stride + (o * kv_heads + h) * head_dim * 2 bytes;
// - a token's slot is block * block_size + offset; a row of the batch reads the keys 0..=ctx of
//   its sequence through the block table at tables + table_off[row].
// Every kernel reads only what its arguments bound; none synchronises with the host.

#include <stdint.h>

// bf16 as its bits (no cuda_bf16.h: it needs CCCL headers the PyPI compiler lacks).
typedef uint16_t bf16;

__device__ __forceinline__ float bf16_to_float(bf16 x) { return __uint_as_float((uint32_t)x << 16); }

__device__ __forceinline__ bf16 float_to_bf16(float x) {
    uint16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    // Sum over a thread block of at most 1024 threads; every thread gets the result.
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    float t = lane < warps ? scratch[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

// x[t, :] = table[ids[t], :] * scale (f32 residual from the bf16 embedding table).
extern "C" __global__ void tandem_embed(const uint32_t* ids, const bf16* table, float* x,
                                        uint32_t hidden, float scale) {
    const bf16* src = table + (uint64_t)ids[blockIdx.x] * hidden;
    float* dst = x + (uint64_t)blockIdx.x * hidden;
    for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = bf16_to_float(src[i]) * scale;
}

// out[r, :] = rmsnorm(x[rows ? rows[r] : r, :]) * w, as bf16. One thread block per output row.
extern "C" __global__ void tandem_rms_norm(const float* x, const uint32_t* rows, const float* w,
                                           bf16* out, uint32_t hidden, float eps) {
    __shared__ float scratch[32];
    uint32_t src_row = rows ? rows[blockIdx.x] : blockIdx.x;
    const float* src = x + (uint64_t)src_row * hidden;
    float ss = 0.f;
    for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x) ss += src[i] * src[i];
    ss = block_sum(ss, scratch);
    float r = rsqrtf(ss / hidden + eps);
    bf16* dst = out + (uint64_t)blockIdx.x * hidden;
    for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = float_to_bf16(w[i] * (src[i] * r));
}

// Rotates each Q and K head of row blockIdx.x of `qkv` by the row's position (rotate-half pairs
// i and i + half, with cos/sin rows of `rope` [max_pos][2][half]), writes Q back in place and K,
// V to the token's slot of the layer's cache.
extern "C" __global__ void tandem_rope_write(bf16* qkv, const uint32_t* positions,
                                             const uint32_t* slots, const float* rope,
                                             uint64_t k_base, uint64_t v_base,
                                             uint64_t block_stride, uint32_t block_size,
                                             uint32_t heads, uint32_t kv_heads, uint32_t head_dim) {
    uint32_t t = blockIdx.x;
    uint32_t half = head_dim / 2;
    uint32_t width = (heads + 2 * kv_heads) * head_dim;
    bf16* row = qkv + (uint64_t)t * width;
    const float* cs = rope + (uint64_t)positions[t] * 2 * half;
    uint32_t slot = slots[t];
    uint64_t block = slot / block_size, offset = slot % block_size;
    bf16* kc = (bf16*)(k_base + block * block_stride) + offset * kv_heads * head_dim;
    bf16* vc = (bf16*)(v_base + block * block_stride) + offset * kv_heads * head_dim;
    // Rotated pairs of Q and K heads.
    for (uint32_t i = threadIdx.x; i < (heads + kv_heads) * half; i += blockDim.x) {
        uint32_t h = i / half, d = i % half;
        bf16* head = row + h * head_dim;
        float x1 = bf16_to_float(head[d]), x2 = bf16_to_float(head[d + half]);
        float c = cs[d], s = cs[half + d];
        bf16 a = float_to_bf16(x1 * c - x2 * s);
        bf16 b = float_to_bf16(x2 * c + x1 * s);
        if (h < heads) {
            head[d] = a;
            head[d + half] = b;
        } else {
            bf16* dst = kc + (h - heads) * head_dim;
            dst[d] = a;
            dst[d + half] = b;
        }
    }
    const bf16* v = row + (heads + kv_heads) * head_dim;
    for (uint32_t i = threadIdx.x; i < kv_heads * head_dim; i += blockDim.x) vc[i] = v[i];
}

// out[t, :] = silu(gu[t, :inter]) * gu[t, inter:] (bf16).
extern "C" __global__ void tandem_silu_mul(const bf16* gu, bf16* out, uint32_t inter, uint64_t total) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < total;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t t = i / inter, j = i % inter;
        float g = bf16_to_float(gu[t * 2 * inter + j]);
        float u = bf16_to_float(gu[t * 2 * inter + inter + j]);
        out[i] = float_to_bf16(g / (1.f + __expf(-g)) * u);
    }
}

// Fills n bf16 values with uniform values in [-scale, scale) from splitmix64(seed + i).
extern "C" __global__ void tandem_fill_uniform_bf16(bf16* w, uint64_t n, uint64_t seed, float scale) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + i * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.f / 16777216.f);  // [0, 1)
        w[i] = float_to_bf16((2.f * u - 1.f) * scale);
    }
}

// Paged attention, one query row per thread-block row of the grid: blockIdx = (row, kv head,
// split). The row's query heads of this KV head (group = heads / kv_heads of them) attend to keys
// [split * chunk, min((split + 1) * chunk, ctx + 1)) of the row's sequence, where ctx is the row's
// own cache index (causal). Each of the 4 warps takes every 4th key; a lane holds DL = D / 32
// dimensions of a key and of each head's running output. Online softmax per warp, merged across
// warps in shared memory; with one split the result goes to `out` (bf16 [row, heads * D]), else
// the unnormalised partial output and its (max, sum) go to `part` for tandem_attention_combine.
template <int D>
__device__ void attention_rows(const bf16* qkv, const uint32_t* ctx_idx, const uint32_t* table_off,
                               const uint32_t* tables, uint64_t k_base, uint64_t v_base,
                               uint64_t block_stride, uint32_t block_size, uint32_t heads,
                               uint32_t kv_heads, float scale, uint32_t chunk, bf16* out,
                               float* part) {
    constexpr int DL = D / 32;
    constexpr int MAXG = 8;
    constexpr int WARPS = 4;
    __shared__ float sm_m[WARPS][MAXG], sm_l[WARPS][MAXG];
    __shared__ float sm_acc[WARPS][MAXG][D];

    const uint32_t row = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const uint32_t group = heads / kv_heads;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint32_t len = ctx_idx[row] + 1;
    const uint32_t begin = split * chunk;
    const uint32_t end = min(len, begin + chunk);
    const uint32_t* table = tables + table_off[row];
    const uint32_t width = (heads + 2 * kv_heads) * D;

    float q[MAXG][DL];
    float m[MAXG], l[MAXG], acc[MAXG][DL];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int d = 0; d < DL; ++d) {
            acc[g][d] = 0.f;
            q[g][d] = 0.f;
        }
        if (g < group) {
            const bf16* qh = qkv + (uint64_t)row * width + (kvh * group + g) * D + lane * DL;
#pragma unroll
            for (int d = 0; d < DL; ++d) q[g][d] = bf16_to_float(qh[d]) * scale;
        }
    }

    for (uint32_t j = begin + warp; j < end; j += WARPS) {
        uint64_t block = table[j / block_size], offset = j % block_size;
        uint64_t within = ((offset * kv_heads + kvh) * D + lane * DL) * 2;
        const bf16* kp = (const bf16*)(k_base + block * block_stride + within);
        const bf16* vp = (const bf16*)(v_base + block * block_stride + within);
        float k[DL], v[DL];
#pragma unroll
        for (int d = 0; d < DL; ++d) {
            k[d] = bf16_to_float(kp[d]);
            v[d] = bf16_to_float(vp[d]);
        }
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g >= group) break;
            float s = 0.f;
#pragma unroll
            for (int d = 0; d < DL; ++d) s += q[g][d] * k[d];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            float mn = fmaxf(m[g], s);
            float c = __expf(m[g] - mn), p = __expf(s - mn);
            l[g] = l[g] * c + p;
#pragma unroll
            for (int d = 0; d < DL; ++d) acc[g][d] = acc[g][d] * c + p * v[d];
            m[g] = mn;
        }
    }

    // Merge the warps.
    for (int g = 0; g < (int)group; ++g) {
        if (lane == 0) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
#pragma unroll
        for (int d = 0; d < DL; ++d) sm_acc[warp][g][lane * DL + d] = acc[g][d];
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < group * D; i += blockDim.x) {
        uint32_t g = i / D, d = i % D;
        float mx = -INFINITY;
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
        float lsum = 0.f, a = 0.f;
        if (mx > -INFINITY) {
            for (int w = 0; w < WARPS; ++w) {
                float c = __expf(sm_m[w][g] - mx);
                lsum += sm_l[w][g] * c;
                a += sm_acc[w][g][d] * c;
            }
        }
        uint32_t h = kvh * group + g;
        if (splits == 1) {
            out[(uint64_t)row * heads * D + h * D + d] = float_to_bf16(lsum > 0.f ? a / lsum : 0.f);
        } else {
            // part layout: [row][head][split] of (D outputs, max, sum).
            float* p = part + (((uint64_t)row * heads + h) * splits + split) * (D + 2);
            p[d] = a;
            if (d == 0) {
                p[D] = mx;
                p[D + 1] = lsum;
            }
        }
    }
}

#define TANDEM_ATTENTION(D)                                                                        \
    extern "C" __global__ void __launch_bounds__(128) tandem_attention_d##D(                       \
        const bf16* qkv, const uint32_t* ctx_idx, const uint32_t* table_off,                       \
        const uint32_t* tables, uint64_t k_base, uint64_t v_base, uint64_t block_stride,           \
        uint32_t block_size, uint32_t heads, uint32_t kv_heads, float scale, uint32_t chunk,       \
        bf16* out, float* part) {                                                                  \
        attention_rows<D>(qkv, ctx_idx, table_off, tables, k_base, v_base, block_stride,           \
                          block_size, heads, kv_heads, scale, chunk, out, part);                   \
    }
TANDEM_ATTENTION(64)
TANDEM_ATTENTION(128)

// Merges the splits of tandem_attention_d*: blockIdx = (row, head), one thread per dimension.
extern "C" __global__ void tandem_attention_combine(const float* part, bf16* out, uint32_t heads,
                                                    uint32_t head_dim, uint32_t splits) {
    uint32_t row = blockIdx.x, h = blockIdx.y;
    const float* p = part + ((uint64_t)row * heads + h) * splits * (head_dim + 2);
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float mx = -INFINITY;
        for (uint32_t s = 0; s < splits; ++s) mx = fmaxf(mx, p[s * (head_dim + 2) + head_dim]);
        float lsum = 0.f, a = 0.f;
        for (uint32_t s = 0; s < splits; ++s) {
            const float* ps = p + s * (head_dim + 2);
            if (ps[head_dim + 1] > 0.f) {
                float c = __expf(ps[head_dim] - mx);
                lsum += ps[head_dim + 1] * c;
                a += ps[d] * c;
            }
        }
        out[(uint64_t)row * heads * head_dim + h * head_dim + d] =
            float_to_bf16(lsum > 0.f ? a / lsum : 0.f);
    }
}

// ---- Prefill attention on tensor cores -------------------------------------------------------
// For steps whose rows are mostly long runs of one sequence (prefill chunks): a thread block
// takes 64 consecutive rows of the step and one query head; each of its 4 warps holds 16 rows.
// Rows of one sequence (equal table_off) form a segment; for each segment the block walks the
// sequence's keys 0..=max ctx of its rows in chunks of 64, staged in shared memory, and each
// warp computes S = Q Kᵀ and O += P V with mma.sync m16n8k16 (bf16 in, f32 accumulate) and an
// online softmax per row; a row sees keys 0..=ctx_idx[row] (causal), rows outside the segment
// are masked. Q·K is summed in f32 from bf16 inputs, the scale applied to the sum, and P is
// rounded to bf16 for the P·V product (the per-row kernel keeps P in f32).

__device__ __forceinline__ void mma_bf16_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two bf16 in one register, the first in the low half (the lower column of an mma fragment).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    return (uint32_t)float_to_bf16(lo) | ((uint32_t)float_to_bf16(hi) << 16);
}

template <int D>
__device__ void prefill_attention(const bf16* qkv, const uint32_t* ctx_idx,
                                  const uint32_t* table_off, const uint32_t* tables,
                                  uint64_t k_base, uint64_t v_base, uint64_t block_stride,
                                  uint32_t block_size, uint32_t heads, uint32_t kv_heads,
                                  float scale, uint32_t rows, bf16* out) {
    constexpr int KT = 64;     // keys per chunk
    constexpr int ROWS = 64;   // query rows per thread block, 16 per warp
    constexpr int PAD = 8;     // bf16 of padding per shared row (bank spread)
    constexpr int SROW = D + PAD;
    __shared__ __align__(16) bf16 sk[KT * SROW];
    __shared__ __align__(16) bf16 sv[KT * SROW];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3;
    const uint32_t h = blockIdx.y, kvh = h / (heads / kv_heads);
    const uint32_t row0 = blockIdx.x * ROWS;
    const uint32_t row_end = min(rows, row0 + ROWS);
    const uint32_t width = (heads + 2 * kv_heads) * D;
    // This thread's two rows of its warp's 16 (fragment rows g and g + 8).
    const uint32_t ra = row0 + warp * 16 + g, rb = ra + 8;
    const bool va = ra < rows, vb = rb < rows;
    const uint32_t ca = va ? ctx_idx[ra] : 0, cb = vb ? ctx_idx[rb] : 0;

    uint32_t qf[D / 16][4];
    {
        const bf16* qa = qkv + (uint64_t)ra * width + h * D + tq * 2;
        const bf16* qb = qkv + (uint64_t)rb * width + h * D + tq * 2;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            qf[kk][0] = va ? *(const uint32_t*)(qa + kk * 16) : 0u;
            qf[kk][1] = vb ? *(const uint32_t*)(qb + kk * 16) : 0u;
            qf[kk][2] = va ? *(const uint32_t*)(qa + kk * 16 + 8) : 0u;
            qf[kk][3] = vb ? *(const uint32_t*)(qb + kk * 16 + 8) : 0u;
        }
    }
    float o[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;

    uint32_t seg = row0;
    while (seg < row_end) {
        const uint32_t toff = table_off[seg];
        uint32_t seg_end = seg + 1;
        uint32_t max_ctx = ctx_idx[seg];
        while (seg_end < row_end && table_off[seg_end] == toff) {
            max_ctx = max(max_ctx, ctx_idx[seg_end]);
            ++seg_end;
        }
        const uint32_t* table = tables + toff;
        const bool in_a = va && ra >= seg && ra < seg_end;
        const bool in_b = vb && rb >= seg && rb < seg_end;
        const bool warp_active = __any_sync(0xffffffffu, in_a || in_b);
        for (uint32_t k0 = 0; k0 <= max_ctx; k0 += KT) {
            __syncthreads();  // the previous chunk's readers are done
            for (int i = threadIdx.x; i < KT * D / 8; i += blockDim.x) {
                const int key = i / (D / 8), c = (i % (D / 8)) * 8;
                const uint32_t j = k0 + key;
                uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
                if (j <= max_ctx) {
                    const uint64_t block = table[j / block_size], off = j % block_size;
                    const uint64_t within = ((off * kv_heads + kvh) * D + c) * 2;
                    kv4 = *(const uint4*)(k_base + block * block_stride + within);
                    vv4 = *(const uint4*)(v_base + block * block_stride + within);
                }
                *(uint4*)(sk + key * SROW + c) = kv4;
                *(uint4*)(sv + key * SROW + c) = vv4;
            }
            __syncthreads();
            if (!warp_active) continue;

            // S = Q Kᵀ for 64 keys: s[n] covers keys k0 + 8n .. k0 + 8n + 8.
            float s[KT / 8][4];
#pragma unroll
            for (int n = 0; n < KT / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
                for (int n = 0; n < KT / 8; ++n) {
                    const bf16* kp = sk + (n * 8 + g) * SROW + kk * 16 + tq * 2;
                    uint32_t b[2] = {*(const uint32_t*)kp, *(const uint32_t*)(kp + 8)};
                    mma_bf16_16816(s[n], qf[kk], b);
                }
            }
            // Mask, scale, and the chunk's row maxima (a row's values sit in a quad of lanes).
            float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
            for (int n = 0; n < KT / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const uint32_t j = k0 + n * 8 + tq * 2 + e;
                    const float xa = (in_a && j <= ca) ? s[n][e] * scale : -INFINITY;
                    const float xb = (in_b && j <= cb) ? s[n][2 + e] * scale : -INFINITY;
                    s[n][e] = xa;
                    s[n][2 + e] = xb;
                    mx_a = fmaxf(mx_a, xa);
                    mx_b = fmaxf(mx_b, xb);
                }
            }
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
            const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
            const bool live_a = mn_a > -INFINITY, live_b = mn_b > -INFINITY;
            const float c_a = live_a ? __expf(m_a - mn_a) : 1.f;
            const float c_b = live_b ? __expf(m_b - mn_b) : 1.f;
            // P as bf16 A fragments: keys 16kk..16kk + 16 are s[2kk] and s[2kk + 1].
            uint32_t pf[KT / 16][4];
            float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
            for (int n = 0; n < KT / 8; ++n) {
                const float p0 = live_a ? __expf(s[n][0] - mn_a) : 0.f;
                const float p1 = live_a ? __expf(s[n][1] - mn_a) : 0.f;
                const float p2 = live_b ? __expf(s[n][2] - mn_b) : 0.f;
                const float p3 = live_b ? __expf(s[n][3] - mn_b) : 0.f;
                sum_a += p0 + p1;
                sum_b += p2 + p3;
                pf[n / 2][(n % 2) * 2] = pack_bf16(p0, p1);
                pf[n / 2][(n % 2) * 2 + 1] = pack_bf16(p2, p3);
            }
            sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 1);
            sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 2);
            sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 1);
            sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 2);
            l_a = l_a * c_a + sum_a;
            l_b = l_b * c_b + sum_b;
            m_a = mn_a;
            m_b = mn_b;
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
                o[dn][0] *= c_a;
                o[dn][1] *= c_a;
                o[dn][2] *= c_b;
                o[dn][3] *= c_b;
            }
            // O += P V: B[key][dim] gathered from the staged V rows.
#pragma unroll
            for (int kk = 0; kk < KT / 16; ++kk) {
#pragma unroll
                for (int dn = 0; dn < D / 8; ++dn) {
                    const bf16* vp = sv + (kk * 16 + tq * 2) * SROW + dn * 8 + g;
                    uint32_t b[2] = {
                        (uint32_t)vp[0] | ((uint32_t)vp[SROW] << 16),
                        (uint32_t)vp[8 * SROW] | ((uint32_t)vp[9 * SROW] << 16),
                    };
                    mma_bf16_16816(o[dn], pf[kk], b);
                }
            }
        }
        seg = seg_end;
    }

    const float ia = l_a > 0.f ? 1.f / l_a : 0.f, ib = l_b > 0.f ? 1.f / l_b : 0.f;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
        const uint32_t d = h * D + dn * 8 + tq * 2;
        if (va) {
            bf16* dst = out + (uint64_t)ra * heads * D + d;
            dst[0] = float_to_bf16(o[dn][0] * ia);
            dst[1] = float_to_bf16(o[dn][1] * ia);
        }
        if (vb) {
            bf16* dst = out + (uint64_t)rb * heads * D + d;
            dst[0] = float_to_bf16(o[dn][2] * ib);
            dst[1] = float_to_bf16(o[dn][3] * ib);
        }
    }
}

#define TANDEM_PREFILL_ATTENTION(D)                                                                \
    extern "C" __global__ void __launch_bounds__(128) tandem_prefill_attention_d##D(               \
        const bf16* qkv, const uint32_t* ctx_idx, const uint32_t* table_off,                       \
        const uint32_t* tables, uint64_t k_base, uint64_t v_base, uint64_t block_stride,           \
        uint32_t block_size, uint32_t heads, uint32_t kv_heads, float scale, uint32_t rows,        \
        bf16* out) {                                                                               \
        prefill_attention<D>(qkv, ctx_idx, table_off, tables, k_base, v_base, block_stride,        \
                             block_size, heads, kv_heads, scale, rows, out);                       \
    }
TANDEM_PREFILL_ATTENTION(64)
TANDEM_PREFILL_ATTENTION(128)
