#!/usr/bin/env bash
# The demo: start Tandem on the embedded default model, send it a streamed chat request,
# print the answer and a few metrics, stop.
# Usage: scripts/demo.sh ["your question"]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
question=${1:-"What is the capital of France? Answer in one sentence."}
./scripts/setup.sh
echo "== building tandem (release)"
cargo build --release --locked -p tandem-server
bin=target/release/tandem
port=${TANDEM_DEMO_PORT:-8100}
log=$(mktemp -t tandem-demo.XXXXXX.log)
"$bin" serve --model smollm2-135m --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.1
done
echo "== server up on :$port ($(grep -m1 'model loaded' "$log" | sed 's/.*model loaded//'))"
echo "== Q: $question"
printf '== A: '
body=$(python3 -c 'import json,sys; print(json.dumps({"model":"smollm2-135m","messages":[{"role":"user","content":sys.argv[1]}],"max_tokens":64,"temperature":0,"stream":True}))' "$question")
curl -sN "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' -d "$body" |
    python3 -c '
import json, sys
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        continue
    ev = json.loads(line[6:])
    for c in ev.get("choices", []):
        sys.stdout.write(c.get("delta", {}).get("content") or "")
        sys.stdout.flush()
print()'
echo "== metrics"
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^tandem:(generation_tokens_total|prompt_tokens_total|kv_cache_usage_perc|time_to_first_token_seconds_(sum|count)) '
