#!/usr/bin/env bash
# Fuzzes the parsers that hostile input reaches (fuzz/fuzz_targets/*.rs), each for
# SECONDS_PER_TARGET (default 600). Not part of the tests: a campaign of its own.
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET]          (from anywhere in the repository)
#   FUZZ_TARGETS="a b"  only these targets (default: every target of `cargo fuzz list`)
#   FUZZ_SANITIZER=none without AddressSanitizer (faster; the default is address)
# Exits non-zero if any target crashes (panic, failed property, timeout, out of memory); the
# input that did it is in fuzz/artifacts/<target>/. Seeds are read from fuzz/corpus/<target>/
# (committed, never written); what the fuzzer learns goes to fuzz/target/corpus/<target>/.
# Inputs in fuzz/regressions/<target>/ (once crashes, now fixed) are replayed before the runs.
#
# The toolchain is stable: cargo-fuzz's nightly flags (-Zsanitizer, -Cpasses=sancov) are let
# through with RUSTC_BOOTSTRAP=1. Builds are optimized with debug assertions and overflow checks
# (-a): an arithmetic overflow on hostile sizes is a finding even where release builds wrap.
set -euo pipefail
secs=${1:-600}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/fuzz"
export RUSTC_BOOTSTRAP=1
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
sanitizer=${FUZZ_SANITIZER:-address}
targets=${FUZZ_TARGETS:-$(cargo fuzz list)}
echo "== cargo fuzz build (sanitizer: $sanitizer)"
cargo fuzz build -a --sanitizer "$sanitizer"
failed=()
# Inputs that once crashed a target (fuzz/regressions/<target>/) must pass first.
for t in $targets; do
    [[ -d "regressions/$t" ]] || continue
    echo "== $t: regressions"
    cargo fuzz run -a --sanitizer "$sanitizer" "$t" "regressions/$t"/* || failed+=("$t (regression)")
done
for t in $targets; do
    echo "== $t: ${secs}s"
    mkdir -p "target/corpus/$t" "corpus/$t"
    if ! cargo fuzz run -a --sanitizer "$sanitizer" "$t" \
        "target/corpus/$t" "corpus/$t" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1; then
        failed+=("$t")
    fi
done
if ((${#failed[@]})); then
    echo "== crashed: ${failed[*]} (inputs in fuzz/artifacts/)"
    exit 1
fi
echo "== no crash in:" $targets
