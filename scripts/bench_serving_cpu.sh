#!/usr/bin/env bash
# Serving on the CPU side by side with llama.cpp's `llama-server`, in one run: the same GGUF (the
# default model's Q4_1 SmolLM2), the same load from `tandem bench` (200-token prompts of token
# ids, 64 output tokens with ignore_eos, greedy, streamed /v1/completions) at 1 and 16 concurrent
# streams, 2 threads each, ROUNDS rounds interleaved (the machine is noisy: compare within a
# round). Prints `tandem bench`'s table (TTFT, ITL, aggregate tokens/s) for each server.
#
# llama-server is built once (5–15 min on 2 cores) into .tools/llama-server-noamx from the
# llama.cpp sources vendored in llama-cpp-python 0.3.36's PyPI sdist (the version bench_cpu.sh
# measures), with cmake from PyPI: GGML_NATIVE=ON without AMX (its AMX path segfaults on the
# Sapphire Rapids VM, see bench_cpu.sh), 16 parallel slots, continuous batching.
# Tandem runs with its default `--dtype auto` unless TANDEM_DTYPE says otherwise.
# Usage: scripts/bench_serving_cpu.sh [ROUNDS] [extra tandem-bench flags]
set -euo pipefail
source "$(dirname "$0")/common.sh"
rounds=${1:-2}
shift || true
./scripts/setup.sh >/dev/null
model=.models/SmolLM2-135M-Instruct.Q4_1.gguf
server=.tools/llama-server-noamx/llama-server
if [ ! -x "$server" ]; then
    echo "bench_serving_cpu: building llama-server (llama.cpp from llama-cpp-python 0.3.36's sdist)"
    python3 -m pip install --quiet cmake ninja
    src=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
        llama-cpp-python==0.3.36 -d "$src"
    tar xzf "$src"/llama_cpp_python-0.3.36.tar.gz -C "$src"
    noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -S "$src/llama_cpp_python-0.3.36/vendor/llama.cpp" -B "$src/build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" >/dev/null
    cmake --build "$src/build" --target llama-server -j "$(nproc)" | tail -n 1
    mkdir -p "$(dirname "$server")"
    cp "$src/build/bin/llama-server" "$server"
    rm -rf "$src"
fi
build_release
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); flags:" \
    "$(grep -m1 '^flags' /proc/cpuinfo | grep -oE 'avx512(f|bw|vl|dq|_vnni)|avx_vnni|avx2|fma|f16c' | sort -u | xargs)"
bench=("$bin" bench --concurrency 1,16 --requests 32 --prompt-tokens 200 --max-tokens 64 "$@")
for r in $(seq 1 "$rounds"); do
    echo "== round $r: Tandem (--dtype ${TANDEM_DTYPE:-auto})"
    RAYON_NUM_THREADS=2 "$bin" serve --model smollm2-135m --host 127.0.0.1 --port 9300 \
        --max-num-seqs 16 >/tmp/tandem-bench-serving.log 2>&1 &
    pids+=($!)
    wait_up http://127.0.0.1:9300
    grep -o 'weights=[a-z0-9_-]*' /tmp/tandem-bench-serving.log | head -n 1
    "${bench[@]}" --url http://127.0.0.1:9300
    cleanup
    echo "== round $r: llama-server, 16 slots"
    # context: 16 slots of 200 + 64 tokens each, rounded up
    "$server" -m "$model" --host 127.0.0.1 --port 9301 -t 2 -tb 2 -np 16 -c 8192 -cb \
        -b 2048 -ub 512 --no-warmup >/tmp/llama-server-bench.log 2>&1 &
    pids+=($!)
    wait_up http://127.0.0.1:9301
    "${bench[@]}" --url http://127.0.0.1:9301
    cleanup
done
