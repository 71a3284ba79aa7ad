#!/usr/bin/env bash
# What one long Gemma 3 request moves in P/D, in one run: pull mode, where each KV cache group
# moves its own table (the sliding-window group only the blocks of its 512-token window), against
# push mode, which still runs one table for every group (every layer moves every prompt block:
# the full-attention layout of the same model). 1P1D on 127.0.0.1 with checksums on
# (fail-closed); one request of TOKENS prompt tokens and 4 greedy output tokens through the
# proxy. Reports the bytes, descriptors and transfer time the mover's /metrics count (the pull
# consumer's READ, the push producer's WRITE), the checksum verdict, and that both answers agree.
# Usage: scripts/bench_hybrid_pd.sh [TOKENS (default 4096)]
#        BIN=target/debug/tandem scripts/bench_hybrid_pd.sh   (skip the release build)
set -euo pipefail
source "$(dirname "$0")/common.sh"
./scripts/setup.sh >/dev/null
if [ -z "${BIN:-}" ]; then build_release; else bin=$BIN; fi
tokens=${1:-4096}
serve_args=(--model gemma3-270m --host 127.0.0.1 --num-kv-blocks 600 --max-model-len 8192)
# A 4k-token Gemma 3 prefill takes longer on a small CPU than the default 30 s of a lease and of a push registration.
checks='"enable_kv_checksum":true,"kv_checksum_fail_closed":true,"kv_connector_extra_config":{"kv_lease_duration":600,"load_timeout":600}'
for mode in pull push; do
    if [ "$mode" = push ]; then connector=NixlPushConnector; mover=9201; else connector=NixlConnector; mover=9301; fi
    "$bin" serve "${serve_args[@]}" --port 9201 \
        --kv-transfer-config "{\"kv_connector\":\"$connector\",\"kv_role\":\"kv_producer\",$checks}" \
        >"/tmp/tandem-hpd-$mode-p.log" 2>&1 & pids+=($!)
    "$bin" serve "${serve_args[@]}" --port 9301 \
        --kv-transfer-config "{\"kv_connector\":\"$connector\",\"kv_role\":\"kv_consumer\",$checks}" \
        >"/tmp/tandem-hpd-$mode-d.log" 2>&1 & pids+=($!)
    "$bin" proxy --host 127.0.0.1 --port 9001 --kv-mode "$mode" \
        --prefill http://127.0.0.1:9201 --decode http://127.0.0.1:9301 \
        >"/tmp/tandem-hpd-$mode-proxy.log" 2>&1 & pids+=($!)
    wait_up http://127.0.0.1:9201
    wait_up http://127.0.0.1:9301
    wait_up http://127.0.0.1:9001
    python3 - "$tokens" "$mode" "$mover" <<'PY'
import json, re, sys, time, urllib.request

tokens, mode, mover = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def post(base, path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=900))
def total(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if not l.startswith("#") and l.split("{")[0].split(" ")[0] == name)
def verdicts(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'tandem:kv_checksum_loads_total\{[^}]*verdict="(\w+)"[^}]*\} (\S+)', text)}
text = "The tide came in over the flats at dusk, and the birds rose in long grey lines. "
# tokenized on the producer: a prefix of it cached on the consumer would load less
ids = post("http://127.0.0.1:9201", "/v1/completions",
           {"prompt": text, "max_tokens": 1, "return_token_ids": True})["prompt_token_ids"]
prompt = (ids * (tokens // len(ids) + 1))[:tokens]
start = time.time()
out = post("http://127.0.0.1:9001", "/v1/completions",
           {"prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True})
wall = time.time() - start
moved = total(mover, "tandem:nixl_bytes_transferred_sum")
descs = total(mover, "tandem:nixl_num_descriptors_sum")
secs = total(mover, "tandem:kv_transfer_seconds_sum")
blocks = -(-tokens // 16)
block_layer = 2 * 16 * 256 * 4  # K and V of 16 tokens, one KV head of 256, f32
print(f"{mode}: {tokens} prompt tokens ({blocks} blocks): moved {moved / 2**20:.2f} MiB "
      f"= {moved / block_layer:.0f} block-layers (18 layers x {blocks} = {18 * blocks}), "
      f"{descs:.0f} descriptors, transfer {secs * 1000:.1f} ms, request {wall:.1f} s, "
      f"verdicts {verdicts(9301)}, output ids {out['choices'][0].get('token_ids')}")
PY
    cleanup
done
