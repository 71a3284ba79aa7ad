#!/usr/bin/env bash
# On the GPU machine: P/D with both instances on one GPU (scripts/gpu_pd_check.py says what is
# checked), in pull and push mode, KV moved VRAM to VRAM by NIXL and verified by the GPU checksum
# kernel. Needs the CUDA build staged by scripts/gpu_build.sh (out/gpu/tandem), the model
# (out/gpu-model/{a,b}, see gpu_build.sh --model) and NIXL for CUDA 13: the nixl-cu13 wheel in
# .tools/wheels (scripts/gpu_build.sh downloads it; the cu12 wheel's UCX CUDA transports do
# not load against CUDA 13), unpacked into out/nixl-cu13 by scripts/gpu_nixl_env.sh.
# Usage: scripts/gpu_pd_check.sh [extra gpu_pd_check.py flags, e.g. --modes pull]
set -euo pipefail
source "$(dirname "$0")/gpu_nixl_env.sh"
if [[ -f out/gpu-model/a && -f out/gpu-model/b && ! -f out/gpu-model/models/SmolLM2-135M-Instruct.Q4_1.gguf ]]; then
    mkdir -p out/gpu-model/models
    cat out/gpu-model/a out/gpu-model/b > out/gpu-model/models/SmolLM2-135M-Instruct.Q4_1.gguf
fi
export TANDEM_MODEL_DIR=${TANDEM_MODEL_DIR:-$root/out/gpu-model/models}
exec python3 scripts/gpu_pd_check.py --bin out/gpu/tandem "$@"
