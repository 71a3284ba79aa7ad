// Tandem's fused KV checksum kernel: the partial checksums of one KV cache group over some cache
// blocks, read straight from the paged cache in device memory.
//
// For every block job and group of layers of a launch, one thread block sums m * x_j * (2j + 1)
// over the block's tokens, the layers' KV heads, and the K then V pieces of each token's rows, and
// adds the sum to out[column * num_blocks + block] with one 64-bit atomic add (all arithmetic wraps mod
// 2^64, so the order of the additions does not change the result). The definition is the one of
// crates/kv-checksum: piece j = t * P + p of the token at request position t, P pieces per token
// (its K row then its V row), m = 2 * (layer * 2^16 + head) + 1.
//
// The layout of a layer is given by strides, so per-layer arrays, block-major arrays across layers,
// token-major or head-major kernel blocks and kernel-block splits all run the same code:
//   row(kv, block, slot, head) = base[kv] + block * block_stride
//                                + (slot / kbs) * kernel_block_stride + (slot % kbs) * token_stride
//                                + head * head_stride
// Two kernels: `kv_checksum_rows` for rows of whole 8-byte pieces (16-byte loads where rows allow
// it), and `kv_checksum_joined` for rows of 4 mod 8 bytes, whose pieces straddle a token's K and V
// rows (read as 4-byte halves).
//
// The job tables travel as one kernel parameter (copied at launch), so a launch needs no host
// staging buffer and never waits for the device.

#include <stdint.h>

#define TANDEM_MAX_LAYERS 32
#define TANDEM_MAX_BLOCKS 256
#define TANDEM_THREADS 256

struct LayerDesc {
    uint64_t k;             // device address of the layer's K array
    uint64_t v;             // device address of the layer's V array
    uint32_t layer_number;  // the number in the layer's name
    uint32_t head_base;     // global index of local head 0
    uint32_t column;        // output column
    uint32_t pad;
};

struct BlockDesc {
    uint64_t t0;            // request position of the first token
    uint32_t block_id;      // cache block id
    uint32_t first_slot;    // slot of the first token within the block
    uint32_t n;             // tokens
    uint32_t index;         // output index within a column
};

struct Launch {
    LayerDesc layers[TANDEM_MAX_LAYERS];
    BlockDesc blocks[TANDEM_MAX_BLOCKS];
    uint64_t block_stride;
    uint64_t kernel_block_stride;
    uint64_t token_stride;
    uint64_t head_stride;
    uint32_t kernel_block_size;
    uint32_t num_heads;
    uint32_t row_bytes;
    uint32_t num_layers;
    uint32_t num_blocks;    // block descs in this launch
    uint32_t out_blocks;    // blocks per output column (the whole job's)
};

static_assert(sizeof(Launch) == 7224, "Launch must match kernels/src/cuda/checksum.rs");

__device__ __forceinline__ uint64_t warp_sum(uint64_t x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    return x;
}

// Adds the thread block's sum of `acc` to *dst (one atomic per thread block). Every thread of the
// block calls it at the same point.
__device__ __forceinline__ void block_add(uint64_t acc, unsigned long long* dst) {
    __shared__ uint64_t partial[TANDEM_THREADS / 32];
    __syncthreads();  // a previous call's reads of `partial` are over
    acc = warp_sum(acc);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0;
        acc = warp_sum(acc);
        if (lane == 0 && acc != 0) atomicAdd(dst, (unsigned long long)acc);
    }
}

// Byte offset, within the block, of each of its `n` tokens' rows of head 0 (shared memory).
__device__ __forceinline__ void token_offsets(const Launch& L, const BlockDesc& b, uint32_t* off) {
    for (uint32_t u = threadIdx.x; u < b.n; u += blockDim.x) {
        const uint32_t slot = b.first_slot + u;
        off[u] = (uint32_t)((slot / L.kernel_block_size) * L.kernel_block_stride +
                            (slot % L.kernel_block_size) * L.token_stride);
    }
    __syncthreads();
}

// Rows of whole pieces. VEC pieces per load (1: 8-byte loads, 2: 16-byte loads). A team of
// `row_vecs = row_bytes / (8 * VEC)` threads reads one row; the block's threads cover
// `rows_per_pass` rows at a time, in the order (K or V, token, head).
template <int VEC>
__device__ __forceinline__ uint64_t rows_sum(const Launch& L, const BlockDesc& b,
                                             const LayerDesc& ly, const uint32_t* off) {
    const uint32_t row_vecs = L.row_bytes / (8 * VEC);
    const uint32_t team = row_vecs < blockDim.x ? row_vecs : blockDim.x;
    const uint32_t rows_per_pass = blockDim.x / team;
    const uint32_t lane = threadIdx.x % team;
    const uint32_t heads = L.num_heads;
    const uint32_t rows = 2 * b.n * heads;
    const uint64_t row_pieces = L.row_bytes / 8;
    const uint64_t pieces_per_token = 2 * row_pieces;
    uint64_t acc = 0;
    if (threadIdx.x < team * rows_per_pass) {
        // This thread's first row, decomposed as (kv, u, h) with h fastest.
        uint32_t r = threadIdx.x / team;
        uint32_t h = r % heads, u = (r / heads) % b.n, kv = r / (heads * b.n);
        const uint32_t step_h = rows_per_pass % heads, step_u = rows_per_pass / heads;
        const uint64_t block_base = (uint64_t)b.block_id * L.block_stride;
        const uint64_t m_base = 2 * (((uint64_t)ly.layer_number << 16) + ly.head_base) + 1;
        if (row_vecs <= blockDim.x) {
            // The common case: this thread reads one load's worth of each of its rows. Addresses
            // and weights of UNROLL rows first, then their loads, so they are in flight together.
            constexpr int UNROLL = 4;
            for (; r < rows; r += UNROLL * rows_per_pass) {
                uint64_t addr[UNROLL], w[UNROLL], m[UNROLL];
#pragma unroll
                for (int k = 0; k < UNROLL; ++k) {
                    const bool live = r + k * rows_per_pass < rows;
                    addr[k] = live ? (kv ? ly.v : ly.k) + block_base + off[u] + h * L.head_stride +
                                         8ull * VEC * lane
                                   : 0;
                    m[k] = m_base + 2ull * h;
                    w[k] = 2 * ((b.t0 + u) * pieces_per_token + kv * row_pieces + VEC * lane) + 1;
                    h += step_h;
                    u += step_u;
                    if (h >= heads) { h -= heads; u += 1; }
                    while (u >= b.n) { u -= b.n; kv += 1; }
                }
                if (VEC == 2) {
                    ulonglong2 x[UNROLL];
#pragma unroll
                    for (int k = 0; k < UNROLL; ++k)
                        x[k] = addr[k] ? __ldg(reinterpret_cast<const ulonglong2*>(addr[k]))
                                       : make_ulonglong2(0, 0);
#pragma unroll
                    for (int k = 0; k < UNROLL; ++k)
                        acc += m[k] * (x[k].x * w[k] + x[k].y * (w[k] + 2));
                } else {
                    uint64_t x[UNROLL];
#pragma unroll
                    for (int k = 0; k < UNROLL; ++k)
                        x[k] = addr[k] ? __ldg(reinterpret_cast<const unsigned long long*>(addr[k]))
                                       : 0;
#pragma unroll
                    for (int k = 0; k < UNROLL; ++k) acc += m[k] * (x[k] * w[k]);
                }
            }
        } else {
            // Rows wider than the block's threads: each thread walks its part of each row.
            for (; r < rows; r += rows_per_pass) {
                const uint64_t base = (kv ? ly.v : ly.k) + block_base + off[u] + h * L.head_stride;
                const uint64_t m = m_base + 2ull * h;
                // Piece index of this row's first piece in the request, then weights 2j + 1.
                const uint64_t j0 = (b.t0 + u) * pieces_per_token + kv * row_pieces;
                for (uint32_t c = lane; c < row_vecs; c += team) {
                    const uint64_t j = j0 + (uint64_t)c * VEC;
                    if (VEC == 2) {
                        const ulonglong2 x =
                            __ldg(reinterpret_cast<const ulonglong2*>(base + 16ull * c));
                        acc += m * (x.x * (2 * j + 1) + x.y * (2 * j + 3));
                    } else {
                        const uint64_t x =
                            __ldg(reinterpret_cast<const unsigned long long*>(base + 8ull * c));
                        acc += m * (x * (2 * j + 1));
                    }
                }
                h += step_h;
                u += step_u;
                if (h >= heads) { h -= heads; u += 1; }
                while (u >= b.n) { u -= b.n; kv += 1; }
            }
        }
    }
    return acc;
}

// Rows of 4 mod 8 bytes: a token's K row and V row are joined into P = row_bytes / 4 pieces
// (2 * row_bytes / 8), read as 4-byte halves; one thread per (token, head, piece) at a time.
__device__ __forceinline__ uint64_t joined_sum(const Launch& L, const BlockDesc& b,
                                               const LayerDesc& ly, const uint32_t* off) {    const uint32_t halves_per_row = L.row_bytes / 4;
    const uint32_t pieces = halves_per_row;  // 2 rows of row_bytes / 4 halves = row_bytes / 4 pieces
    const uint64_t total = (uint64_t)b.n * L.num_heads * pieces;
    const uint64_t block_base = (uint64_t)b.block_id * L.block_stride;
    uint64_t acc = 0;
    for (uint64_t i = threadIdx.x; i < total; i += blockDim.x) {
        const uint32_t p = (uint32_t)(i % pieces);
        const uint64_t th = i / pieces;
        const uint32_t h = (uint32_t)(th % L.num_heads);
        const uint32_t u = (uint32_t)(th / L.num_heads);
        const uint64_t row = block_base + off[u] + h * L.head_stride;
        uint32_t half[2];
        for (int e = 0; e < 2; ++e) {
            const uint32_t q = 2 * p + e;  // half index in the joined row
            const uint64_t addr = q < halves_per_row ? ly.k + row + 4ull * q
                                                     : ly.v + row + 4ull * (q - halves_per_row);
            half[e] = __ldg(reinterpret_cast<const unsigned int*>(addr));
        }
        const uint64_t x = (uint64_t)half[0] | ((uint64_t)half[1] << 32);
        const uint64_t j = (b.t0 + u) * pieces + p;
        const uint64_t m = 2 * (((uint64_t)ly.layer_number << 16) + ly.head_base + h) + 1;
        acc += m * (x * (2 * j + 1));
    }
    return acc;
}

// One thread block per (block desc, group of layers): the block's token offsets are computed
// once, the layers of the group (blockIdx.y, + gridDim.y, ...) summed, and the sum added to the
// output once per run of layers with the same column.
template <typename LayerSum>
__device__ __forceinline__ void checksum(const Launch& L, unsigned long long* out, LayerSum sum) {
    extern __shared__ uint32_t off[];
    const BlockDesc b = L.blocks[blockIdx.x];
    token_offsets(L, b, off);
    uint32_t column = L.layers[blockIdx.y].column;
    uint64_t acc = 0;
    for (uint32_t l = blockIdx.y; l < L.num_layers; l += gridDim.y) {
        const LayerDesc ly = L.layers[l];
        if (ly.column != column) {
            block_add(acc, out + (uint64_t)column * L.out_blocks + b.index);
            acc = 0;
            column = ly.column;
        }
        acc += sum(L, b, ly, off);
    }
    block_add(acc, out + (uint64_t)column * L.out_blocks + b.index);
}

// Grid: (block descs, layer groups <= num_layers); TANDEM_THREADS threads; dynamic shared memory
// 4 * (largest n) bytes.
extern "C" __global__ void __launch_bounds__(TANDEM_THREADS)
kv_checksum_rows8(const __grid_constant__ Launch L, unsigned long long* out) {
    checksum(L, out, rows_sum<1>);
}

extern "C" __global__ void __launch_bounds__(TANDEM_THREADS)
kv_checksum_rows16(const __grid_constant__ Launch L, unsigned long long* out) {
    checksum(L, out, rows_sum<2>);
}

extern "C" __global__ void __launch_bounds__(TANDEM_THREADS)
kv_checksum_joined(const __grid_constant__ Launch L, unsigned long long* out) {
    checksum(L, out, joined_sum);
}
