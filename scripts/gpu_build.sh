#!/usr/bin/env bash
# Builds Tandem's CUDA programs on a machine without a GPU and stages them in out/gpu/ for the GPU
# machine (which has the driver but no Rust): the GPU tests (kernels/tests/cuda_checksum.rs,
# kernels/tests/cuda_decoder.rs, models/tests/cuda_models.rs), tandem-gpu-bench (checksum kernel)
# and tandem-gpu-model-bench (the decoder on the 8B shape), stripped. nvcc 13.0 comes from PyPI
# (scripts/cuda_toolchain.sh), and `tandem` itself with `--device cuda` (scripts/gpu_serve_check.sh).
# The cuda builds share target/ with the CPU ones: build the CPU binary again afterwards. With --model, also stages the embedded model in two halves under
# out/gpu-model/ (a device call carries at most 64 MiB: carry one half per call). NIXL for CUDA 13
# (the nixl-cu13 wheel, 59 MB: carry .tools/wheels in a call of its own) is downloaded into
# .tools/wheels for scripts/gpu_pd_check.sh. Then, on the GPU machine, from the repository root:
# scripts/gpu_run.sh, scripts/gpu_pd_check.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export CUDA_ROOT=${CUDA_ROOT:-$("$root/scripts/cuda_toolchain.sh")}
if ! ls .tools/wheels/nixl_cu13-1.5.1-*.whl >/dev/null 2>&1; then
    python3 -m pip download --quiet --no-deps -d .tools/wheels nixl-cu13==1.5.1
fi
cargo build --release -p tandem-kernels --features cuda --bins
cargo build --release -p tandem-server --features cuda --bin tandem --bin tandem-gpu-nixl-probe
mkdir -p out/gpu
stage_test() { # package feature-crate test-name
    local exe
    exe=$(cargo test --release -p "$1" --features cuda --test "$2" --no-run \
        --message-format=json 2>/dev/null | python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == name:
        print(m["executable"])' "$2")
    strip -o "out/gpu/$2" "$exe"
}
stage_test tandem-kernels cuda_checksum
stage_test tandem-kernels cuda_decoder
stage_test tandem-models cuda_models
strip -o out/gpu/tandem target/release/tandem
strip -o out/gpu/tandem-gpu-nixl-probe target/release/tandem-gpu-nixl-probe
strip -o out/gpu/tandem-gpu-bench target/release/tandem-gpu-bench
strip -o out/gpu/tandem-gpu-model-bench target/release/tandem-gpu-model-bench
if [[ "${1:-}" == "--model" ]]; then
    mkdir -p out/gpu-model
    model=.models/SmolLM2-135M-Instruct.Q4_1.gguf
    half=$(( ($(stat -c %s "$model") + 1) / 2 ))
    head -c "$half" "$model" > out/gpu-model/a
    tail -c +"$((half + 1))" "$model" > out/gpu-model/b
fi
ls -la out/gpu out/gpu-model 2>/dev/null || true
du -sh out/gpu
