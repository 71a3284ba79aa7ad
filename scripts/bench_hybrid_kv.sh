#!/usr/bin/env bash
# KV blocks and bytes one long Gemma 3 request holds, with a block table per KV cache group (the
# sliding-window group frees what leaves its 512-token window) against one table all groups
# share (every layer keeps every block: what push-mode P/D runs), in one run. Each instance serves
# one request of TOKENS prompt tokens and STEPS output tokens while /metrics is polled; the
# most blocks held per group (pool total minus free) are reported, and bytes from Gemma 3 270M's
# shape (3 full-attention and 15 sliding layers, 1 KV head of 256, the f32 cache). The most
# includes a prefill step's new blocks (--max-num-batched-tokens; this script's default 2048: pass CHUNK);
# "held while decoding" is the last sample before the answer.
# Usage: CHUNK=512 scripts/bench_hybrid_kv.sh ...  (the prefill chunk)
# Usage: scripts/bench_hybrid_kv.sh [TOKENS (default 4096)] [STEPS (default 32)]
#        BIN=target/debug/tandem scripts/bench_hybrid_kv.sh   (skip the release build)
set -euo pipefail
source "$(dirname "$0")/common.sh"
./scripts/setup.sh >/dev/null
if [ -z "${BIN:-}" ]; then build_release; else bin=$BIN; fi
tokens=${1:-4096}
steps=${2:-32}
common=(--model gemma3-270m --host 127.0.0.1 --num-kv-blocks 600 --max-model-len 8192
    --max-num-batched-tokens "${CHUNK:-2048}")
"$bin" serve "${common[@]}" --port 9230 >/tmp/tandem-hk-hybrid.log 2>&1 & pids+=($!)
# a push-mode transfer config (never used: no request asks for a transfer) gives one shared table
"$bin" serve "${common[@]}" --port 9231 \
    --kv-transfer-config '{"kv_connector":"NixlPushConnector","kv_role":"kv_both"}' \
    >/tmp/tandem-hk-shared.log 2>&1 & pids+=($!)
wait_up http://127.0.0.1:9230
wait_up http://127.0.0.1:9231
python3 - "$tokens" "$steps" <<'PY'
import json, re, sys, threading, time, urllib.request

tokens, steps = int(sys.argv[1]), int(sys.argv[2])
def post(base, path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))
def gauges(base):
    """{(metric name, group label): value} of the per-group KV cache gauges."""
    out = {}
    for line in urllib.request.urlopen(base + "/metrics").read().decode().splitlines():
        m = re.match(r'(tandem:kv_cache_group_\w+)\{.*group="(\d+)".*\} (\S+)$', line)
        if m:
            out[(m[1], m[2])] = float(m[3])
    return out
text = "The tide came in over the flats at dusk, and the birds rose in long grey lines. "
base0 = "http://127.0.0.1:9230"
ids = post(base0, "/v1/completions", {"prompt": text, "max_tokens": 1, "return_token_ids": True})["prompt_token_ids"]
prompt = (ids * (tokens // len(ids) + 1))[:tokens]
block_bytes = 16 * 2 * 1 * 256 * 4  # one block of one layer: 16 tokens, K and V, f32
layers = {"0": 3, "1": 15}
for name, port in (("per-group tables", 9230), ("one shared table", 9231)):
    base = f"http://127.0.0.1:{port}"
    most, last = {}, {}
    done = threading.Event()
    def poll():
        while not done.is_set():
            g = gauges(base)
            for grp in ("0", "1"):
                total = g.get(("tandem:kv_cache_group_total_blocks", grp))
                free = g.get(("tandem:kv_cache_group_free_blocks", grp))
                if total is not None and free is not None:
                    most[grp] = max(most.get(grp, 0), total - free)
                    if total > free:
                        last[grp] = total - free
            time.sleep(0.05)
    t = threading.Thread(target=poll); t.start()
    start = time.time()
    out = post(base, "/v1/completions", {"prompt": prompt, "max_tokens": steps, "temperature": 0, "ignore_eos": True})
    done.set(); t.join()
    n = out["usage"]["completion_tokens"]
    if len(most) == 1:  # one pool: every block holds all 18 layers
        held = {"0": most["0"], "1": most["0"]}
        pools = "one pool (18 layers per block)"
    else:
        held = most
        pools = "group 0 (3 layers per block), group 1 (15 layers per block)"
    nbytes = sum(held[g] * layers[g] * block_bytes for g in ("0", "1"))
    print(f"{name:17s} {tokens}+{n} tokens in {time.time() - start:5.1f} s [{pools}]: most blocks held {most} "
          f"= {nbytes / 2**20:.1f} MiB of KV; held while decoding {last}")
PY
