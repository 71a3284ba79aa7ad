#!/usr/bin/env bash
# Push against pull, one run: the same 1P1D deployment on 127.0.0.1 (checksums on, fail-closed)
# in pull mode (NixlConnector) and in push mode (NixlPushConnector, proxy --kv-mode push), with
# the same `tandem bench` load. Prints TTFT, ITL and throughput per concurrency, and the KV
# transfer bandwidth (the side that moves the bytes: the pull consumer's READs, the push
# producer's WRITEs) against process_vm_readv of the same bytes.
# Usage: scripts/bench_push.sh [tandem-bench flags, e.g. --concurrency 1,16 --requests 16 --max-tokens 32]
set -euo pipefail
source "$(dirname "$0")/common.sh"
./scripts/setup.sh >/dev/null
build_release
serve_args=(--model smollm2-135m --host 127.0.0.1 ${TANDEM_BENCH_SERVE_ARGS:-})
checks='"enable_kv_checksum":true'
for mode in pull push; do
    if [ "$mode" = push ]; then connector=NixlPushConnector; else connector=NixlConnector; fi
    echo "== 1P1D, $mode mode"
    "$bin" serve "${serve_args[@]}" --port 9200 \
        --kv-transfer-config "{\"kv_connector\":\"$connector\",\"kv_role\":\"kv_producer\",$checks}" \
        >"/tmp/tandem-bench-$mode-p.log" 2>&1 & pids+=($!)
    "$bin" serve "${serve_args[@]}" --port 9300 \
        --kv-transfer-config "{\"kv_connector\":\"$connector\",\"kv_role\":\"kv_consumer\",$checks,\"kv_checksum_fail_closed\":true}" \
        >"/tmp/tandem-bench-$mode-d.log" 2>&1 & pids+=($!)
    "$bin" proxy --host 127.0.0.1 --port 9000 --kv-mode "$mode" \
        --prefill http://127.0.0.1:9200 --decode http://127.0.0.1:9300 \
        >"/tmp/tandem-bench-$mode-proxy.log" 2>&1 & pids+=($!)
    wait_up http://127.0.0.1:9200
    wait_up http://127.0.0.1:9300
    wait_up http://127.0.0.1:9000
    # The transfer counters live where the bytes are moved from.
    if [ "$mode" = push ]; then mover=9200; else mover=9300; fi
    "$bin" bench --url http://127.0.0.1:9000 --kv-metrics-url "http://127.0.0.1:$mover" "$@"
    curl -s http://127.0.0.1:9300/metrics | grep '^tandem:kv_checksum_loads_total' || true
    cleanup
done
