#!/usr/bin/env bash
# The demo: a 1P1D deployment on the embedded default model — a prefill instance (KV producer),
# a decode instance (KV consumer) and the Tandem proxy — one streamed chat request through the
# proxy, then the answer's KV transfer and checksum metrics. Everything stops at the end.
#
# Usage: scripts/demo.sh ["your question"]
#   TANDEM_DEMO_FAULT=corrupt_byte scripts/demo.sh   injects a corrupted byte into every load
#   (the decode instance catches it by checksum and recomputes the prompt).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
question=${1:-"What is the capital of France? Answer in one sentence."}
fault=${TANDEM_DEMO_FAULT:-}
./scripts/setup.sh
echo "== building tandem (release)"
cargo build --release --locked -p tandem-server 2>&1 | tail -n 1
bin=target/release/tandem
base=${TANDEM_DEMO_PORT:-8000}
pport=$((base + 100)); dport=$((base + 200))
logs=$(mktemp -d -t tandem-demo.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# Both instances share a fresh KV transfer secret: the producer signs its kv_transfer_params, the
# consumer accepts only signed ones (see README, Security).
export TANDEM_KV_TRANSFER_SECRET=${TANDEM_KV_TRANSFER_SECRET:-$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')}
checksum='"enable_kv_checksum":true'
consumer="{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_consumer\",$checksum,\"kv_checksum_fail_closed\":true,\"kv_load_failure_policy\":\"recompute\""
if [ -n "$fault" ]; then
    consumer="$consumer,\"kv_fault_injection\":{\"kind\":\"$fault\",\"probability\":1.0,\"seed\":1}"
fi
consumer="$consumer}"
"$bin" serve --model smollm2-135m --host 127.0.0.1 --port "$pport" \
    --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_producer\",$checksum}" \
    >"$logs/prefill.log" 2>&1 & pids+=($!)
"$bin" serve --model smollm2-135m --host 127.0.0.1 --port "$dport" \
    --kv-transfer-config "$consumer" >"$logs/decode.log" 2>&1 & pids+=($!)
"$bin" proxy --host 127.0.0.1 --port "$base" \
    --prefill "http://127.0.0.1:$pport" --decode "http://127.0.0.1:$dport" \
    >"$logs/proxy.log" 2>&1 & pids+=($!)
for _ in $(seq 1 600); do
    # The proxy answers /health once both instances are in its rotation.
    if curl -sf "http://127.0.0.1:$base/health" >/dev/null; then break; fi
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || { tail -n 20 "$logs"/*.log; exit 1; }; done
    sleep 0.2
done
curl -sf "http://127.0.0.1:$base/health" >/dev/null || { echo "the deployment did not come up; logs in $logs"; exit 1; }
echo "== 1P1D up: prefill :$pport, decode :$dport, proxy :$base, signed KV transfer params (logs in $logs)${fault:+, fault injection: $fault}"
echo "== Q: $question"
printf '== A: '
body=$(python3 -c 'import json,sys; print(json.dumps({"model":"smollm2-135m","messages":[{"role":"user","content":sys.argv[1]}],"max_tokens":64,"temperature":0,"stream":True}))' "$question")
curl -sN "http://127.0.0.1:$base/v1/chat/completions" -H 'content-type: application/json' -d "$body" |
    python3 -c '
import json, sys
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        continue
    ev = json.loads(line[6:])
    if "error" in ev:
        print("\n[error] " + ev["error"]["message"]); break
    for c in ev.get("choices", []):
        sys.stdout.write(c.get("delta", {}).get("content") or "")
        sys.stdout.flush()
print()'
sleep 0.3
echo "== decode instance: KV transfer and checksum metrics"
curl -s "http://127.0.0.1:$dport/metrics" |
    grep -E '^tandem:(kv_transfer_(bytes|failures|refused)_total|kv_transfer_seconds_(sum|count)|kv_checksum_(loads|unverified|mismatched_blocks)_total|kv_checksum_compute_seconds_(sum|count)|kv_load_failures_total)' |
    grep -vE '_(unverified|refused)_total\{.*\} 0$' || true
echo "== prefill instance"
curl -s "http://127.0.0.1:$pport/metrics" |
    grep -E '^tandem:(kv_checksum_sends_total|kv_lease_expired_total|kv_cache_free_blocks|kv_cache_total_blocks)[ {]' || true
