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
echo "== cargo test"
cargo test --workspace --locked -- --test-threads 2
