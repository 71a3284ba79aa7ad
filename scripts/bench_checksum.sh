#!/usr/bin/env bash
# KV checksum overhead in P/D: the same 1P1D load with checksums off, then on (fail-closed), in one
# run. Prints `tandem bench` for each and, with checksums on, the worker time spent checksumming
# on each side (tandem:kv_checksum_compute_seconds) against the time to first token.
# Usage: scripts/bench_checksum.sh [tandem-bench flags; default --concurrency 1 --requests 24 --max-tokens 4]
set -euo pipefail
source "$(dirname "$0")/common.sh"
./scripts/setup.sh >/dev/null
build_release
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--concurrency 1 --requests 24 --max-tokens 4)
for mode in off on; do
    extra=''
    [ "$mode" = on ] && extra=',"enable_kv_checksum":true,"kv_checksum_fail_closed":true'
    "$bin" serve --host 127.0.0.1 --port 9200 \
        --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_producer\"$extra}" >/tmp/tandem-bc-p.log 2>&1 & pids+=($!)
    "$bin" serve --host 127.0.0.1 --port 9300 \
        --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_consumer\"$extra}" >/tmp/tandem-bc-d.log 2>&1 & pids+=($!)
    "$bin" proxy --host 127.0.0.1 --port 9000 --prefill http://127.0.0.1:9200 --decode http://127.0.0.1:9300 >/tmp/tandem-bc-x.log 2>&1 & pids+=($!)
    wait_up http://127.0.0.1:9000
    echo "== 1P1D, checksums $mode"
    "$bin" bench --url http://127.0.0.1:9000 "${args[@]}"
    t=$(metric http://127.0.0.1:9300 'tandem:time_to_first_token_seconds_sum')
    n=$(metric http://127.0.0.1:9300 'tandem:time_to_first_token_seconds_count')
    echo "consumer load-to-first-token (its own TTFT, load included): $(python3 -c "print(f'{1000*float(\"$t\")/float(\"$n\"):.2f}')") ms mean over $n requests"
    if [ "$mode" = on ]; then
        for side in 9200:producer 9300:consumer; do
            port=${side%%:*}; name=${side#*:}
            s=$(metric "http://127.0.0.1:$port" 'tandem:kv_checksum_compute_seconds_sum')
            c=$(metric "http://127.0.0.1:$port" 'tandem:kv_checksum_compute_seconds_count')
            t=$(metric "http://127.0.0.1:$port" 'tandem:time_to_first_token_seconds_sum')
            n=$(metric "http://127.0.0.1:$port" 'tandem:time_to_first_token_seconds_count')
            echo "$name: checksum worker time ${s:-0} s over ${c:-0} records; TTFT sum ${t:-0} s over ${n:-0} requests" \
                "($(python3 -c "print(f'{100*float(\"${s:-0}\")/max(float(\"${t:-1}\"),1e-9):.3f}')")% of TTFT)"
        done
    fi
    cleanup
    sleep 0.5
done
