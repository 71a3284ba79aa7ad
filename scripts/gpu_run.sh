#!/usr/bin/env bash
# Runs on the GPU machine what scripts/gpu_build.sh staged: the GPU tests, then the benchmarks
# (checksum kernel in both cache arrangements, the decoder on the 8B shape). Needs the NVIDIA
# driver (libcuda.so.1) and cuBLAS (/usr/local/cuda/lib64). The SmolLM2 comparison needs the
# model: out/gpu-model/{a,b} (see gpu_build.sh --model) are joined into out/gpu-model/models/.
# `gpu_run.sh tests` or `gpu_run.sh bench` runs one half.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if [[ -f "$root/out/gpu-model/a" && -f "$root/out/gpu-model/b" ]]; then
    mkdir -p "$root/out/gpu-model/models"
    cat "$root/out/gpu-model/a" "$root/out/gpu-model/b" \
        > "$root/out/gpu-model/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    export TANDEM_MODEL_DIR="$root/out/gpu-model/models"
fi
cd "$root/out/gpu"
if [[ "$what" == all || "$what" == tests ]]; then
    ./cuda_checksum --test-threads=1
    ./cuda_decoder --test-threads=1 --nocapture
    if [[ -n "${TANDEM_MODEL_DIR:-}" ]]; then
        ./cuda_models --test-threads=1 --nocapture
    else
        ./cuda_models --test-threads=1 --nocapture --skip smollm2
        echo "SmolLM2 comparison not run: stage the model with gpu_build.sh --model"
    fi
fi
if [[ "$what" == all || "$what" == bench ]]; then
    ./tandem-gpu-bench --arrangement block-major
    ./tandem-gpu-bench --arrangement per-layer
    ./tandem-gpu-model-bench
fi
