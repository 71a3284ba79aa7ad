// Kernels for tests and benchmarks only: filling device memory with a reproducible pattern, and
// keeping a stream busy for a known time (a stand-in for an engine step's forward).

#include <stdint.h>

// x[i] = splitmix64(seed + i): distinct, reproducible bytes without a host upload.
extern "C" __global__ void tandem_fill_hash(unsigned long long* x, uint64_t n, uint64_t seed) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + i * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        x[i] = z ^ (z >> 31);
    }
}

// Spins one thread for `ns` nanoseconds of the device's global timer.
extern "C" __global__ void tandem_spin(uint64_t ns) {
    uint64_t start;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
        uint64_t now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start >= ns) break;
    }
}
