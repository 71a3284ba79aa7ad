#!/usr/bin/env bash
# Builds the Docker Compose demo's images on a machine without a container registry: no base
# image, nothing pulled. Each image is a root file system assembled here (`FROM scratch` in
# effect) and loaded with `docker import`:
#   tandem:latest             the host-built `tandem` binary, exactly the shared libraries it and
#                             NIXL load (ldd of the binary, of NIXL's libraries, its plugins and
#                             UCX's transports), NIXL's two library folders from .nixl/, the model
#                             from .models/; runs as uid 10001, entrypoint `tandem`
#   tandem-prometheus:latest  Debian's Prometheus (from .tools/prometheus, see scripts/setup.sh)
#                             with its libraries, and `tandem health` for its healthcheck
# Usage: scripts/docker-images.sh [BINARY]
#   BINARY  the `tandem` binary to ship (default: target/release/tandem, built if missing)
#   TANDEM_IMAGE, TANDEM_PROMETHEUS_IMAGE  the image names (defaults above)
# Then: docker compose -f docker/docker-compose.yml -f docker/docker-compose.local.yml up --wait
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tandem_image=${TANDEM_IMAGE:-tandem:latest}
prometheus_image=${TANDEM_PROMETHEUS_IMAGE:-tandem-prometheus:latest}
uid=10001

binary=${1:-}
if [ -z "$binary" ]; then
    binary=target/release/tandem
    if [ ! -x "$binary" ]; then
        echo "docker-images: building tandem (release)"
        cargo build --release --locked -p tandem-server 2>&1 | tail -n 1
    fi
fi
[ -x "$binary" ] || { echo "docker-images: no executable at $binary" >&2; exit 1; }
nixl_libs=.nixl/.nixl_cu12.mesonpy.libs
nixl_deps=.nixl/nixl_cu12.libs
prom=.tools/prometheus/usr/bin/prometheus
for need in "$nixl_libs/libnixl_capi.so" "$nixl_deps" "$prom"; do
    [ -e "$need" ] || { echo "docker-images: $need is missing: run scripts/setup.sh" >&2; exit 1; }
done
models=$(find -L .models -maxdepth 1 -name '*.gguf' | sort)
[ -n "$models" ] || { echo "docker-images: no model in .models/: run scripts/setup.sh" >&2; exit 1; }

stage=$(mktemp -d -t tandem-images.XXXXXX)
trap 'rm -rf "$stage"' EXIT

# Copies into ROOTFS every shared library (outside the NIXL tree, which travels whole) that the
# given files load, by the path the dynamic linker resolved, plus the interpreter.
copy_libraries() {
    local rootfs=$1; shift
    { ldd "$@" 2>/dev/null || true; } |
        awk '/=> \// { print $3 } /^[[:space:]]*\/[^ ]*ld-linux/ { print $1 }' |
        { grep -v '/\.nixl/' || true; } | sort -u |
        while read -r lib; do
            [ -e "$lib" ] || continue
            mkdir -p "$rootfs$(dirname "$lib")"
            cp -L "$lib" "$rootfs$lib"
        done
}

# The pieces every image has: a user, a writable /tmp, the library search path.
base_rootfs() {
    local rootfs=$1
    mkdir -p "$rootfs"/{etc,tmp,usr/local/bin}
    chmod 1777 "$rootfs/tmp"
    printf 'root:x:0:0:root:/root:/sbin/nologin\ntandem:x:%s:%s:tandem:/tmp:/sbin/nologin\n' "$uid" "$uid" >"$rootfs/etc/passwd"
    printf 'root:x:0:\ntandem:x:%s:\n' "$uid" >"$rootfs/etc/group"
    printf 'hosts: files dns\n' >"$rootfs/etc/nsswitch.conf"
}

import() {
    local rootfs=$1 name=$2; shift 2
    local changes=()
    for c in "$@"; do changes+=(--change "$c"); done
    local old
    old=$(docker image inspect --format '{{.Id}}' "$name" 2>/dev/null || true)
    tar --numeric-owner -C "$rootfs" -c . | docker import "${changes[@]}" - "$name" >/dev/null
    # The image this name held before is dropped unless a container still uses it.
    if [ -n "$old" ] && [ "$old" != "$(docker image inspect --format '{{.Id}}' "$name")" ]; then
        docker rmi "$old" >/dev/null 2>&1 || true
    fi
    echo "docker-images: $name ($(du -sh "$rootfs" | cut -f1))"
}

start=$(date +%s)
# --- tandem
t=$stage/tandem
base_rootfs "$t"
cp -L "$binary" "$t/usr/local/bin/tandem"
mkdir -p "$t/opt/tandem/.nixl" "$t/opt/tandem/.models"
# The two library folders of NIXL's wheel, side by side: the UCX plugin finds UCX's libraries
# through its relative rpath (../../nixl_cu12.libs), UCX its transports in nixl_cu12.libs/ucx.
cp -rL "$nixl_libs" "$nixl_deps" "$t/opt/tandem/.nixl/"
for m in $models; do cp -L "$m" "$t/opt/tandem/.models/"; done
mapfile -t shared < <(find -L "$nixl_libs" "$nixl_deps" -name '*.so*' -type f)
copy_libraries "$t" "$binary" "${shared[@]}"
import "$t" "$tandem_image" \
    "ENV PATH=/usr/local/bin" \
    "ENV LD_LIBRARY_PATH=/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu" \
    "ENV TANDEM_MODEL_DIR=/opt/tandem/.models" \
    "ENV TANDEM_NIXL_LIB_DIR=/opt/tandem/.nixl/.nixl_cu12.mesonpy.libs" \
    "ENV HOME=/tmp" \
    "WORKDIR /opt/tandem" \
    "USER $uid:$uid" \
    'ENTRYPOINT ["/usr/local/bin/tandem"]' \
    'CMD ["serve", "--model", "smollm2-135m"]'

# --- prometheus
p=$stage/prometheus
base_rootfs "$p"
mkdir -p "$p/bin" "$p/etc/prometheus" "$p/prometheus"
cp -L "$prom" "$p/bin/prometheus"
cp -L "$binary" "$p/usr/local/bin/tandem"
chown "$uid:$uid" "$p/prometheus"
copy_libraries "$p" "$prom" "$binary"
import "$p" "$prometheus_image" \
    "ENV PATH=/bin:/usr/local/bin" \
    "ENV LD_LIBRARY_PATH=/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu" \
    "WORKDIR /prometheus" \
    "USER $uid:$uid" \
    'ENTRYPOINT ["/bin/prometheus"]' \
    'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'
echo "docker-images: done in $(( $(date +%s) - start )) s"
