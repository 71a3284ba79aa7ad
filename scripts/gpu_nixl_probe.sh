#!/usr/bin/env bash
# On the GPU machine: what a NIXL READ between two processes on one GPU costs per region
# (out/gpu/tandem-gpu-nixl-probe, staged by scripts/gpu_build.sh), once per UCX setting given
# as an argument ("" = Tandem's defaults), e.g.
#   scripts/gpu_nixl_probe.sh "" "UCX_PROTO_ENABLE=n"
# NIXL for CUDA 13 as scripts/gpu_nixl_env.sh sets it up.
set -euo pipefail
source "$(dirname "$0")/gpu_nixl_env.sh"
[[ $# -gt 0 ]] || set -- ""
for setting in "$@"; do
    echo "## UCX setting: ${setting:-(defaults)}"
    # shellcheck disable=SC2086
    env $setting out/gpu/tandem-gpu-nixl-probe "${ROUNDS:-7}"
done
