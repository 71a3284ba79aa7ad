#!/usr/bin/env bash
# CPU forward side by side with llama.cpp, in one run: Tandem's `bench_model` example on the
# default model's Q4_1 GGUF (`native` / `native-i8`: our Q4_1 kernel with f32 / 8-bit inputs in
# each instruction-set variant this CPU runs, and native-i8 without VNNI where the CPU has it (what an
# AVX2-only CPU runs);
# `native-amx`: native-i8, which runs AMX tiles where the CPU has AMX-INT8;
# `q8_0`: re-quantized for candle's Q8_0 kernels) and llama.cpp through llama-cpp-python on the same file,
# prompt (200 tokens) and decode steps, 2 threads each, ROUNDS rounds interleaved (the machine is
# noisy: compare within a round).
#
# llama-cpp-python is built from its PyPI source once (5–15 min on 2 cores) into
# .tools/llama-cpp-native-noamx, with GGML_NATIVE=ON (llama.cpp's best for this CPU that runs:
# AMX off, see below).
# Usage: scripts/bench_cpu.sh [ROUNDS] [STEPS]   (BENCH_PROMPT_LEN=512 for a 512-token prompt)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
steps=${2:-32}
./scripts/setup.sh >/dev/null
model=.models/SmolLM2-135M-Instruct.Q4_1.gguf
lcp=.tools/llama-cpp-native-noamx
if ! PYTHONPATH=$lcp python3 -c "import llama_cpp" 2>/dev/null; then
    echo "bench_cpu: building llama-cpp-python 0.3.36 (llama.cpp, GGML_NATIVE=ON, no AMX) into $lcp"
    # -mno-amx-*: llama.cpp's AMX path segfaults on the first eval on a Sapphire Rapids VM
    # (2026-12-04); without it the build keeps AVX-512, VNNI and its repacked kernels
    noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_C_FLAGS='$noamx' -DCMAKE_CXX_FLAGS='$noamx'" \
        python3 -m pip install --no-cache-dir --quiet --target "$lcp" llama-cpp-python==0.3.36 numpy
fi
cargo build --release --locked -p tandem-models --example bench_model 2>&1 | tail -n 1
variants=$(python3 - <<'PY'
import re
flags = open("/proc/cpuinfo").read()
have = lambda *f: all(re.search(rf"\b{x}\b", flags) for x in f)
v = []
if have("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"):
    if have("amx_tile", "amx_int8"):
        v += ["native-amx@avx512"]
    v += ["native@avx512", "native-i8@avx512"]
    if have("avx512_vnni"):
        v += ["native-i8@avx512-novnni"]
if have("avx2", "fma", "f16c"):
    v += ["native@avx2", "native-i8@avx2"]
    if have("avx_vnni") or have("avx512_vnni"):
        v += ["native-i8@avx2-novnni"]
print(",".join(v + ["q8_0"]))
PY
)
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); flags:" \
    "$(grep -m1 '^flags' /proc/cpuinfo | grep -oE 'avx512(f|bw|vl|dq|_vnni)|avx2|fma|f16c' | sort -u | xargs)"
for r in $(seq 1 "$rounds"); do
    echo "== round $r"
    RAYON_NUM_THREADS=2 target/release/examples/bench_model smollm2-135m "$variants" "$steps" |
        grep -E '^\| (weights|[a-z0-9_-]+@)'
    echo "| llama.cpp | prefill tok/s | decode tok/s (b=1) | step b=1 ms |"
    PYTHONPATH=$lcp python3 scripts/llama_cpp_bench.py "$model" "$steps" 2
done
