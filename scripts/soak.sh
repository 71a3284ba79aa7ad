#!/usr/bin/env bash
# KV checksum soak: N clean P/D loads (default 10000) through the proxy, signed params, checksums
# on, fail-closed consumer; every load must verify: zero mismatches, zero unverified, zero load
# failures (a false mismatch is a checksum bug). A benchmark, not a test.
# Usage: scripts/soak.sh [REQUESTS] [CONCURRENCY]     (defaults 10000 8)
set -euo pipefail
source "$(dirname "$0")/common.sh"
./scripts/setup.sh >/dev/null
build_release
n=${1:-10000}
c=${2:-8}
export TANDEM_KV_TRANSFER_SECRET=soak-deployment-secret-0123456789
on='"enable_kv_checksum":true'
"$bin" serve --host 127.0.0.1 --port 9210 \
    --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_producer\",$on}" >/tmp/tandem-soak-p.log 2>&1 & pids+=($!)
"$bin" serve --host 127.0.0.1 --port 9310 \
    --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_consumer\",$on,\"kv_checksum_fail_closed\":true,\"kv_load_failure_policy\":\"fail\"}" >/tmp/tandem-soak-d.log 2>&1 & pids+=($!)
"$bin" proxy --host 127.0.0.1 --port 9010 --prefill http://127.0.0.1:9210 --decode http://127.0.0.1:9310 >/tmp/tandem-soak-x.log 2>&1 & pids+=($!)
wait_up http://127.0.0.1:9210; wait_up http://127.0.0.1:9310; wait_up http://127.0.0.1:9010
start=$(date +%s)
"$bin" bench --url http://127.0.0.1:9010 --concurrency "$c" --requests "$n" --prompt-tokens 64 --max-tokens 2
secs=$(( $(date +%s) - start ))
d=http://127.0.0.1:9310
verified=$(metric $d 'tandem:kv_checksum_loads_total{verdict="verified"}')
mismatch=$(metric $d 'tandem:kv_checksum_loads_total{verdict="mismatch"}')
unverified=$(metric $d 'tandem:kv_checksum_loads_total{verdict="unverified"}')
failures=$(metric $d 'tandem:kv_load_failures_total{policy="fail"}')
sends=$(metric http://127.0.0.1:9210 'tandem:kv_checksum_sends_total')
echo "soak: $n requests at concurrency $c in ${secs} s: sends ${sends:-0}, verified ${verified:-0}, mismatch ${mismatch:-0}, unverified ${unverified:-0}, load failures ${failures:-0}"
# `tandem bench` sends one warm-up request before the N: every load the producer checksummed
# (sends) must have verified, and there must be at least N of them.
[ "${verified:-0}" = "${sends:-x}" ] && [ "${verified:-0}" -ge "$n" ] && [ -z "$mismatch" ] \
    && [ -z "$unverified" ] && [ -z "$failures" ] \
    && echo "soak: ok, every load verified" || { echo "soak: FAILED"; exit 1; }
