#!/usr/bin/env bash
# Serving benchmark: one instance against a 1P1D deployment behind the proxy, same load, one run.
# Prints `tandem bench` tables (TTFT, ITL, throughput at each concurrency) and, for 1P1D, the KV
# transfer bandwidth inside P/D requests against memcpy and process_vm_readv of the same bytes.
# Usage: scripts/bench.sh [extra tandem-bench flags, e.g. --concurrency 1,16 --max-tokens 64]
# With guidellm installed (GUIDELLM=path, default .tools/guidellm/bin/guidellm; see README), it
# also drives each deployment with guidellm at tandem bench's default load (200-token prompts,
# 64 output tokens, 32 requests at 1 and 16 streams), its tables printed after Tandem's.
set -euo pipefail
source "$(dirname "$0")/common.sh"
./scripts/setup.sh >/dev/null
build_release
serve_args=(--model smollm2-135m --host 127.0.0.1 ${TANDEM_BENCH_SERVE_ARGS:-})
guidellm=${GUIDELLM:-.tools/guidellm/bin/guidellm}
guidellm_run() { # URL
    [ -x "$guidellm" ] || return 0
    local tok=/tmp/tandem-bench-tokenizer
    "$bin" export-tokenizer --model smollm2-135m "$tok" >/dev/null
    for streams in 1 16; do
        echo "-- guidellm, $streams stream(s)"
        HF_HUB_OFFLINE=1 "$guidellm" run --disable-console-interactive \
            --backend "kind=openai_http,target=$1,model=smollm2-135m,request_format=/v1/completions" \
            --profile "kind=concurrent,streams=$streams" \
            --data kind=synthetic_text,prompt_tokens=200,output_tokens=64 \
            --tokenizer "kind=huggingface_auto,model=$tok" \
            --constraint kind=max_requests,count=32 \
            --output "kind=json,path=/tmp/tandem-bench-guidellm-$streams.json" 2>&1 |
            sed -n '/Request Latency Statistics/,/^$/p;/Server Throughput Statistics/,/^$/p'
    done
}

echo "== single instance"
"$bin" serve "${serve_args[@]}" --port 9100 >/tmp/tandem-bench-single.log 2>&1 & pids+=($!)
wait_up http://127.0.0.1:9100
"$bin" bench --url http://127.0.0.1:9100 "$@"
guidellm_run http://127.0.0.1:9100
cleanup

echo "== 1P1D behind the proxy"
"$bin" serve "${serve_args[@]}" --port 9200 \
    --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}' >/tmp/tandem-bench-p.log 2>&1 & pids+=($!)
"$bin" serve "${serve_args[@]}" --port 9300 \
    --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}' >/tmp/tandem-bench-d.log 2>&1 & pids+=($!)
"$bin" proxy --host 127.0.0.1 --port 9000 --prefill http://127.0.0.1:9200 --decode http://127.0.0.1:9300 \
    >/tmp/tandem-bench-proxy.log 2>&1 & pids+=($!)
wait_up http://127.0.0.1:9000
"$bin" bench --url http://127.0.0.1:9000 --kv-metrics-url http://127.0.0.1:9300 "$@"
guidellm_run http://127.0.0.1:9000
