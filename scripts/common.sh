# Sourced (not run) by the scripts that start tandem processes: enters the repository root, and
# gives `build_release` (the release binary, path in $bin), `wait_up URL` (until its /health
# answers), `metric URL NAME` (the sum of NAME's series on URL's /metrics, whatever their labels)
# and `cleanup` (stops every process whose pid is in $pids; also runs on exit).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build_release() {
    cargo build --release --locked -p tandem-server 2>&1 | tail -n 1
    bin=target/release/tandem
}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap cleanup EXIT
metric() { curl -s "$1/metrics" | awk -v n="$2" '{ split($1, s, "{") } s[1] == n { t += $2; f = 1 } END { if (f) print t }'; }
wait_up() { for _ in $(seq 1 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.2; done; echo "$1 did not come up"; exit 1; }
