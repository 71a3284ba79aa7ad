//! CUDA kernels (KV checksum, cache writes, paged attention), built only with the `cuda` feature. Empty for now: the CPU build needs nothing from here.
