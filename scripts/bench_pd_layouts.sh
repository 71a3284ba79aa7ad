#!/usr/bin/env bash
# P/D across parallel layouts, one run: the same 1P1D pull deployment (head-major caches,
# checksums on, fail-closed) with (P TP, D TP) = (1,1), (3,1) and (1,3), the same `tandem bench`
# load through the proxy. Prints TTFT, ITL and throughput, the decode instance's KV transfer
# bandwidth against memcpy and process_vm_readv of the same bytes, and the descriptors and bytes
# per load: a consumer reading heads from several producer ranks (or one head per rank) moves the
# same bytes in more, smaller descriptors.
# Usage: scripts/bench_pd_layouts.sh [tandem-bench flags, e.g. --concurrency 1 --requests 16]
set -euo pipefail
source "$(dirname "$0")/common.sh"
./scripts/setup.sh >/dev/null
build_release
serve_args=(--host 127.0.0.1 --kv-cache-layout head_major ${TANDEM_BENCH_SERVE_ARGS:-})
checks='"kv_connector":"NixlConnector","enable_kv_checksum":true'
for pair in "1 1" "3 1" "1 3"; do
    read -r ptp dtp <<<"$pair"
    echo "== P TP $ptp -> D TP $dtp"
    "$bin" serve "${serve_args[@]}" --port 9200 --tensor-parallel-size "$ptp" \
        --kv-transfer-config "{$checks,\"kv_role\":\"kv_producer\"}" \
        >"/tmp/tandem-bench-layouts-p.log" 2>&1 & pids+=($!)
    "$bin" serve "${serve_args[@]}" --port 9300 --tensor-parallel-size "$dtp" \
        --kv-transfer-config "{$checks,\"kv_role\":\"kv_consumer\",\"kv_checksum_fail_closed\":true}" \
        >"/tmp/tandem-bench-layouts-d.log" 2>&1 & pids+=($!)
    "$bin" proxy --host 127.0.0.1 --port 9000 \
        --prefill http://127.0.0.1:9200 --decode http://127.0.0.1:9300 \
        >"/tmp/tandem-bench-layouts-proxy.log" 2>&1 & pids+=($!)
    wait_up http://127.0.0.1:9200
    wait_up http://127.0.0.1:9300
    wait_up http://127.0.0.1:9000
    "$bin" bench --url http://127.0.0.1:9000 --kv-metrics-url http://127.0.0.1:9300 "$@"
    loads=$(metric http://127.0.0.1:9300 tandem:kv_transfer_seconds_count)
    desc=$(metric http://127.0.0.1:9300 tandem:kv_transfer_descriptors_total)
    bytes=$(metric http://127.0.0.1:9300 tandem:kv_transfer_bytes_total)
    awk -v l="$loads" -v d="$desc" -v b="$bytes" -v dtp="$dtp" 'BEGIN {
        printf "per load: %.0f descriptors, %.0f bytes (%.0f per consumer rank)\n", d / l, b / l, b / l / dtp }'
    curl -s http://127.0.0.1:9300/metrics | grep '^tandem:kv_checksum_loads_total' || true
    cleanup
done
