#!/usr/bin/env bash
# Partial against whole recompute after a late-block corruption, in one run: one producer and
# three consumers (fail-closed, policy recompute, prefix caching off so every request loads):
#   clean    no fault: the load verifies (the baseline)
#   partial  a byte corrupted in the prompt's last block; kv_partial_recompute (the default)
#   whole    the same fault with "kv_partial_recompute": false
# For each of REPS rounds the same prompt of TOKENS tokens is prefilled on the producer and loaded
# by each consumer in turn; the consumer's request time (max_tokens 1: its time to first token,
# load and recompute included) is measured by curl. Prints the median per consumer and the ratios.
# Usage: scripts/bench_recompute.sh [TOKENS (default 2048)] [REPS (default 7)]
set -euo pipefail
source "$(dirname "$0")/common.sh"
./scripts/setup.sh >/dev/null
build_release
tokens=${1:-2048}
reps=${2:-7}
P=http://127.0.0.1:9210
"$bin" serve --host 127.0.0.1 --port 9210 --num-kv-blocks 512 \
    --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer","enable_kv_checksum":true}' \
    >/tmp/tandem-br-p.log 2>&1 & pids+=($!)
wait_up $P
# A prompt of exactly $tokens token ids: a text's ids, repeated.
text="The river flows through the old town, past the market and the mill, under seven stone bridges and along the gardens of the abbey, where the monks once kept bees and grew pears for the winter."
ids=$(curl -sf $P/v1/completions -H 'content-type: application/json' \
    -d "$(python3 -c 'import json,sys; print(json.dumps({"prompt": sys.argv[1], "max_tokens": 1, "return_token_ids": True}))' "$text")" |
    python3 -c 'import json,sys; ids=json.load(sys.stdin)["prompt_token_ids"]; n=int(sys.argv[1]); print(json.dumps((ids*(n//len(ids)+1))[:n]))' "$tokens")
last=$(( (tokens - 1) / 16 ))
consumer() { # name port extra-config
    "$bin" serve --host 127.0.0.1 --port "$2" --num-kv-blocks 512 --enable-prefix-caching false \
        --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_consumer\",\"enable_kv_checksum\":true,\"kv_checksum_fail_closed\":true,\"kv_load_failure_policy\":\"recompute\"$3}" \
        >"/tmp/tandem-br-$1.log" 2>&1 & pids+=($!)
}
fault=",\"kv_fault_injection\":{\"kind\":\"corrupt_byte\",\"block_position\":$last}"
consumer clean 9311 ''
consumer partial 9312 "$fault"
consumer whole 9313 "$fault,\"kv_partial_recompute\":false"
for port in 9311 9312 9313; do wait_up http://127.0.0.1:$port; done
out=$(mktemp)
for r in $(seq 0 "$reps"); do
    for c in clean:9311 partial:9312 whole:9313; do
        params=$(curl -sf $P/v1/completions -H 'content-type: application/json' \
            -d "{\"prompt\": $ids, \"max_tokens\": 1, \"temperature\": 0, \"kv_transfer_params\": {\"do_remote_decode\": true}}" |
            python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["kv_transfer_params"]))')
        t=$(curl -sf -o /dev/null -w '%{time_total}' "http://127.0.0.1:${c#*:}/v1/completions" \
            -H 'content-type: application/json' \
            -d "{\"prompt\": $ids, \"max_tokens\": 1, \"temperature\": 0, \"kv_transfer_params\": $params}")
        [ "$r" -gt 0 ] && echo "${c%%:*} $t" >>"$out" # round 0 warms up
    done
done
echo "== $tokens-token prompt, corruption in block $last (the last), $reps rounds"
for c in clean:9311 partial:9312 whole:9313; do
    r=$(metric "http://127.0.0.1:${c#*:}" 'tandem:kv_load_recomputed_tokens_total')
    p=$(metric "http://127.0.0.1:${c#*:}" 'tandem:prompt_tokens_total')
    echo "${c%%:*}: recomputed ${r:-0} tokens in all, prompt tokens computed ${p:-0} (rounds 0-$reps)"
done
python3 - "$out" <<'PY'
import statistics, sys
t = {}
for line in open(sys.argv[1]):
    name, s = line.split()
    t.setdefault(name, []).append(float(s) * 1000)
med = {k: statistics.median(v) for k, v in t.items()}
for k in ("clean", "partial", "whole"):
    print(f"{k:8s} TTFT median {med[k]:8.1f} ms  (min {min(t[k]):.1f}, max {max(t[k]):.1f})")
print(f"partial / whole: {med['partial'] / med['whole']:.3f}   partial / clean: {med['partial'] / med['clean']:.2f}")
PY
rm -f "$out"
