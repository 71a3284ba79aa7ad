#!/usr/bin/env bash
# The test command: installs what the tests need, then format check, lints, and every test.
# Usage: scripts/test.sh            (from anywhere in the repository)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
./scripts/setup.sh
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy --all-targets -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== the cuda feature builds and lints (nvcc 13.0 from PyPI; no GPU needed to build)"
CUDA_ROOT=$(./scripts/cuda_toolchain.sh) cargo clippy -p tandem-kernels --features cuda --all-targets --locked -- -D warnings
echo "== cargo test"
cargo test --workspace --locked -- --test-threads 2
