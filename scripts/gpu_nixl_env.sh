# Sourced (not run) by the scripts that run NIXL on the GPU machine: enters the repository root,
# puts the CUDA libraries on the loader's path, unpacks NIXL for CUDA 13 (the nixl-cu13 wheel in
# .tools/wheels, which scripts/gpu_build.sh downloads; the cu12 wheel's UCX CUDA transports do
# not load against CUDA 13) into out/nixl-cu13 once, exports TANDEM_NIXL_LIB_DIR, and prints
# the GPU.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
if [[ ! -f out/nixl-cu13/.nixl_cu13.mesonpy.libs/libnixl_capi.so ]]; then
    wheel=$(ls .tools/wheels/nixl_cu13-*.whl | head -1)
    mkdir -p out/nixl-cu13
    python3 -m zipfile -e "$wheel" out/nixl-cu13
fi
export TANDEM_NIXL_LIB_DIR=$root/out/nixl-cu13/.nixl_cu13.mesonpy.libs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
