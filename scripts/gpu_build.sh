#!/usr/bin/env bash
# Builds Tandem's CUDA programs on a machine without a GPU and stages them in out/gpu/ for the GPU
# machine (which has the driver but no Rust): the GPU tests (kernels/tests/cuda_checksum.rs) and
# tandem-gpu-bench. nvcc 13.0 comes from PyPI (scripts/cuda_toolchain.sh). Then, on the GPU
# machine, from the repository root: scripts/gpu_run.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export CUDA_ROOT=${CUDA_ROOT:-$("$root/scripts/cuda_toolchain.sh")}
cargo build --release -p tandem-kernels --features cuda --bins
tests=$(cargo test --release -p tandem-kernels --features cuda --test cuda_checksum --no-run \
    --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_checksum":
        print(m["executable"])')
mkdir -p out/gpu
cp "$tests" out/gpu/cuda_checksum
cp target/release/tandem-gpu-bench out/gpu/
ls -la out/gpu
