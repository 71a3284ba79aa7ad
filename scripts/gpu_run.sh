#!/usr/bin/env bash
# Runs on the GPU machine what scripts/gpu_build.sh staged: the GPU tests, then the checksum
# kernel benchmark in both cache arrangements. Needs the NVIDIA driver (libcuda.so.1) only.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/out/gpu"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
./cuda_checksum --test-threads=1 --nocapture
./tandem-gpu-bench --arrangement block-major "$@"
./tandem-gpu-bench --arrangement per-layer "$@"
