#!/usr/bin/env bash
# The test command: installs what the tests need, then format check, lints, and every test.
# Usage: scripts/test.sh            (from anywhere in the repository)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# Each phase prints the minutes:seconds since the start, so a slow run shows where it went.
phase() { printf "== [%d:%02d] %s\n" $((SECONDS / 60)) $((SECONDS % 60)) "$1"; }
phase "setup"
./scripts/setup.sh
phase "cargo fmt --check"
cargo fmt --all -- --check
phase "cargo clippy --all-targets -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
phase "the cuda feature builds and lints (nvcc 13.0 from PyPI; no GPU needed to build)"
cuda_root=$(./scripts/cuda_toolchain.sh)
CUDA_ROOT=$cuda_root cargo clippy -p tandem-kernels -p tandem-models -p tandem-server \
    --features tandem-kernels/cuda,tandem-models/cuda,tandem-server/cuda --all-targets --locked \
    -- -D warnings
# The GPU decoder's host side (model refusals, batch translation, step bounds) is plain Rust in
# tandem-models' gpu_batch and tandem-kernels' step: `cargo test` runs its tests without the
# feature (a build of the test profile with it took ~6 min).
phase "cargo test"
cargo test --workspace --locked -- --test-threads 2
phase "done"
