#!/usr/bin/env bash
# On the GPU machine: what a NIXL READ between two processes on one GPU costs per region
# (out/gpu/tandem-gpu-nixl-probe, staged by scripts/gpu_build.sh), once per UCX setting given
# as an argument ("" = Tandem's defaults), e.g.
#   scripts/gpu_nixl_probe.sh "" "UCX_PROTO_ENABLE=n"
# NIXL for CUDA 13 as scripts/gpu_pd_check.sh finds it (out/nixl-cu13, from .tools/wheels).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
if [[ ! -f out/nixl-cu13/.nixl_cu13.mesonpy.libs/libnixl_capi.so ]]; then
    wheel=$(ls .tools/wheels/nixl_cu13-*.whl | head -1)
    mkdir -p out/nixl-cu13
    python3 -m zipfile -e "$wheel" out/nixl-cu13
fi
export TANDEM_NIXL_LIB_DIR=$root/out/nixl-cu13/.nixl_cu13.mesonpy.libs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
[[ $# -gt 0 ]] || set -- ""
for setting in "$@"; do
    echo "## UCX setting: ${setting:-(defaults)}"
    # shellcheck disable=SC2086
    env $setting out/gpu/tandem-gpu-nixl-probe "${ROUNDS:-7}"
done
