#!/usr/bin/env bash
# On the GPU machine: serves the embedded model with `tandem serve --device cuda` (staged in out/gpu
# by scripts/gpu_build.sh, the model joined by scripts/gpu_run.sh) and checks it as a user would:
# a greedy chat completion that must name Paris, a streamed completion, and the engine's metrics.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export TANDEM_MODEL_DIR=${TANDEM_MODEL_DIR:-$root/out/gpu-model/models}
port=${PORT:-8391}
log=$(mktemp)
"$root/out/gpu/tandem" serve --device cuda --model smollm2-135m --host 127.0.0.1 --port "$port" \
    --kv-cache-memory 2GiB >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $pid 2>/dev/null || { cat "$log"; echo "tandem exited"; exit 1; }
    sleep 0.5
done
grep -m1 "model loaded" "$log" || true
answer=$(curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"smollm2-135m","temperature":0,"max_tokens":24,
         "messages":[{"role":"user","content":"What is the capital of France?"}]}')
echo "chat: $answer"
echo "$answer" | python3 -c 'import json,sys; t=json.load(sys.stdin)["choices"][0]["message"]["content"]; assert "Paris" in t, t; print("OK: the answer names Paris")'
curl -sfN "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
    -d '{"model":"smollm2-135m","prompt":"1, 2, 3, 4,","temperature":0,"max_tokens":8,"stream":true}' \
    | grep -c '^data: {' | xargs -I{} echo "stream: {} events"
curl -sf "http://127.0.0.1:$port/metrics" | grep -E '^tandem:(generation_tokens_total|request_success_total)' | head -4
