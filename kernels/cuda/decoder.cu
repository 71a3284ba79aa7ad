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
