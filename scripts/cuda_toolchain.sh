#!/usr/bin/env bash
# Installs the CUDA compiler Tandem's `cuda` feature builds with, without a GPU or a system CUDA
# toolkit: the pinned NVIDIA wheels from PyPI, unpacked into .tools/cuda (idempotent).
# Prints the CUDA_ROOT to use. nvcc is pinned to 13.0.x: 13.1 and newer emit PTX that the
# H200 machine's driver (580) cannot JIT. Tandem's kernels need no CCCL (CUB, Thrust), so it is left out.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/.tools/cuda"
cuda_root="$dir/nvidia/cu13"
if [ ! -x "$cuda_root/bin/nvcc" ] || [ ! -f "$dir/.complete" ]; then
    echo "cuda_toolchain: installing nvcc 13.0 from PyPI into $dir" >&2
    rm -rf "$dir"
    mkdir -p "$dir"
    python3 -m pip install --quiet --no-deps --target "$dir" \
        nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
        nvidia-cuda-runtime==13.0.96 >&2
    touch "$dir/.complete"
fi
echo "$cuda_root"
