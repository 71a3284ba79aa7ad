#!/usr/bin/env bash
# The Docker Compose demo on a machine without a container registry: builds `tandem` (release),
# assembles the images from this machine's files (scripts/docker-images.sh), starts prefill,
# decode (two replicas), the proxy and Prometheus with docker/docker-compose.yml +
# docker/docker-compose.local.yml, waits until every container is healthy, sends one chat
# request through the proxy, and leaves the deployment running.
#
# Usage: scripts/compose-demo.sh [up|down]      (default: up)
#   TANDEM_DECODE_REPLICAS (2), TANDEM_PROXY_PORT (8000), TANDEM_PROMETHEUS_PORT (9090)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
project=${COMPOSE_PROJECT_NAME:-tandem}
files=(-f docker/docker-compose.yml -f docker/docker-compose.local.yml)
if docker compose version >/dev/null 2>&1; then
    compose=(docker compose -p "$project" "${files[@]}")
else
    compose=(docker-compose -p "$project" "${files[@]}")
fi
if [ "${1:-up}" = down ]; then
    "${compose[@]}" down -v --remove-orphans
    exit 0
fi

./scripts/setup.sh
echo "== building tandem (release)"
cargo build --release --locked -p tandem-server 2>&1 | tail -n 1
echo "== images"
./scripts/docker-images.sh target/release/tandem
# A fresh deployment secret: the P/D instances listen on the Compose network and sign their
# kv_transfer_params with it (see README, Security).
export TANDEM_KV_TRANSFER_SECRET=${TANDEM_KV_TRANSFER_SECRET:-$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')}
replicas=${TANDEM_DECODE_REPLICAS:-2}
echo "== compose up (decode replicas: $replicas)"
start=$(date +%s)
if [ "${compose[0]}" = docker ]; then
    "${compose[@]}" up -d --wait --scale "decode=$replicas"
else
    # docker-compose v1 has no --wait: its depends_on conditions already held the proxy and
    # Prometheus back until what they need was healthy; wait for the last ones here.
    "${compose[@]}" up -d --scale "decode=$replicas"
    for _ in $(seq 1 240); do
        states=$(docker inspect --format '{{.State.Health.Status}}' $("${compose[@]}" ps -q) | sort -u)
        [ "$states" = healthy ] && break
        sleep 1
    done
    [ "$states" = healthy ] || { "${compose[@]}" ps; echo "the deployment did not become healthy"; exit 1; }
fi
echo "== healthy in $(( $(date +%s) - start )) s"
"${compose[@]}" ps
port=${TANDEM_PROXY_PORT:-8000}
echo "== Q: What is the capital of France?"
printf '== A: '
curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"smollm2-135m","messages":[{"role":"user","content":"What is the capital of France? Answer in one sentence."}],"max_tokens":48,"temperature":0}' |
    python3 -c 'import json,sys; v=json.load(sys.stdin); print(v["choices"][0]["message"]["content"] if "choices" in v else v)'
cat <<MSG
== running:
   dashboard   http://127.0.0.1:$port/dashboard
   API         http://127.0.0.1:$port/v1/chat/completions
   Prometheus  http://127.0.0.1:${TANDEM_PROMETHEUS_PORT:-9090}  (tandem:kv_checksum_loads_total)
   stop with   scripts/compose-demo.sh down
MSG
