#!/usr/bin/env bash
# Tensor parallelism on the CPU, one run: the same single instance at TP 1 and at TP N (default
# 3; SmolLM2 splits its 9 heads and 3 KV heads at TP 1 or 3), with the same `tandem bench` load.
# On a CPU the TP ranks are threads sharing the same cores, so this measures what splitting a
# step costs (the collectives' share of a step: each rank's seconds in all-reduce/gather,
# waiting for the others included, against the engine's step seconds), not a speed-up.
# Usage: scripts/bench_parallel.sh [tandem-bench flags, e.g. --concurrency 1,16 --requests 32]
# Environment: TANDEM_BENCH_TP (default 3), TANDEM_BENCH_SERVE_ARGS (extra `tandem serve` flags).
set -euo pipefail
source "$(dirname "$0")/common.sh"
./scripts/setup.sh >/dev/null
build_release
tp=${TANDEM_BENCH_TP:-3}
for size in 1 "$tp"; do
    echo "== TP $size"
    "$bin" serve --host 127.0.0.1 --port 9100 --tensor-parallel-size "$size" \
        ${TANDEM_BENCH_SERVE_ARGS:-} >"/tmp/tandem-bench-tp$size.log" 2>&1 & pids+=($!)
    wait_up http://127.0.0.1:9100
    "$bin" bench --url http://127.0.0.1:9100 "$@"
    steps=$(metric http://127.0.0.1:9100 'tandem:engine_step_seconds_sum')
    if [ "$size" != 1 ]; then
        coll=$(metric http://127.0.0.1:9100 'tandem:parallel_collective_seconds')
        awk -v c="$coll" -v s="$steps" -v n="$size" 'BEGIN {
            printf "engine step seconds %.2f, collectives %.2f s per rank on average: %.1f%% of a step\n",
                s, c / n, 100 * c / n / s }'
    else
        echo "engine step seconds $steps"
    fi
    cleanup
done
