#!/usr/bin/env bash
# Build spotrl's image where no image registry is reachable (air-gapped clusters, CI here):
#   1. base: a Debian bookworm image with Python 3.11 (a venv at /opt/venv first on PATH) and
#      redis-server, made by debootstrap from the Debian mirror apt is configured with; it serves
#      as the Python base and as the Redis image
#   2. wheelhouse: torch and every dependency, resolved by the base image's own Python (its
#      3.11.2 needs packages a newer host Python does not) with the host's pip settings
#   3. image: `docker build --network host`, pip reading only the wheelhouse, served on
#      127.0.0.1 for the length of the build
# Each step is skipped when its inputs are unchanged (base: the image exists; wheelhouse: a hash
# of requirements.lock, pyproject.toml and TORCH_SPEC; image: a hash of every file it is made of,
# kept as its label org.spotrl.inputs; and Docker's layer cache within a build).
#
# usage: tools/offline-image.sh            (as root: debootstrap needs it; DOCKER_HOST is honoured)
# env:   SPOTRL_IMAGE (spotrl:latest), SPOTRL_BASE_IMAGE (spotrl-base:bookworm),
#        SPOTRL_DEBIAN_MIRROR (default: the mirror apt uses), SPOTRL_CACHE (~/.cache/spotrl),
#        TORCH_SPEC (torch==2.13.0)
# Then: SPOTRL_REDIS_IMAGE=spotrl-base:bookworm docker compose up -d   (it prints the line)
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE="${SPOTRL_IMAGE:-spotrl:latest}"
BASE="${SPOTRL_BASE_IMAGE:-spotrl-base:bookworm}"
CACHE="${SPOTRL_CACHE:-$HOME/.cache/spotrl}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
SUITE=bookworm
say() { echo "offline-image: $*" >&2; }

apt_mirror() {
    # the first Debian URI apt is configured with (deb822 .sources, then one-line lists)
    local uri
    uri=$(grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' \
        | grep -v security | head -n1 || true)
    if [ -z "$uri" ]; then
        uri=$(grep -hsE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
            | awk '{print $2}' | grep -v security | head -n1 || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

build_base() {
    if docker image inspect "$BASE" >/dev/null 2>&1; then
        say "base $BASE: present"
        return
    fi
    command -v debootstrap >/dev/null || { say "debootstrap is not installed (apt-get install debootstrap)"; exit 2; }
    local mirror rootfs
    mirror="${SPOTRL_DEBIAN_MIRROR:-$(apt_mirror)}"
    rootfs=$(mktemp -d "${TMPDIR:-/tmp}/spotrl-rootfs.XXXXXX")
    trap 'rm -rf "$rootfs"' RETURN
    say "base $BASE: debootstrap $SUITE from $mirror"
    debootstrap --variant=minbase \
        --include=python3,python3-venv,python3-pip,redis-server,redis-tools,ca-certificates \
        "$SUITE" "$rootfs" "$mirror" >"$CACHE/debootstrap.log" 2>&1 \
        || { tail -n 20 "$CACHE/debootstrap.log" >&2; exit 1; }
    chroot "$rootfs" python3 -m venv /opt/venv
    chroot "$rootfs" /opt/venv/bin/pip --version >/dev/null
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" -c . | docker import \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        - "$BASE" >/dev/null
    say "base $BASE: $(docker image inspect -f '{{.Size}}' "$BASE" | awk '{printf "%d MB", $1/1e6}')"
}

build_wheelhouse() {
    local key
    key=$( { cat requirements.lock pyproject.toml; echo "$TORCH_SPEC";
             docker image inspect -f '{{.Id}}' "$BASE"; } | sha256sum | cut -c1-16)
    WHEELHOUSE="$CACHE/wheelhouse-$key"
    if [ -f "$WHEELHOUSE/.complete" ]; then
        say "wheelhouse: $WHEELHOUSE (cached)"
        return
    fi
    rm -rf "$WHEELHOUSE" && mkdir -p "$WHEELHOUSE"
    # the host's pip settings reach the index: its CA bundle and its local wheel folders
    local args=(--rm --network host -v "$PWD:/src:ro" -v "$WHEELHOUSE:/wh")
    local links=()
    for d in ${PIP_FIND_LINKS:-}; do
        if [ -d "$d" ]; then args+=(-v "$d:$d:ro"); links+=("$d"); fi
    done
    [ ${#links[@]} -gt 0 ] && args+=(-e "PIP_FIND_LINKS=${links[*]}")
    if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
        args+=(-v "$PIP_CERT:/etc/spotrl-ca.crt:ro" -e PIP_CERT=/etc/spotrl-ca.crt)
    fi
    [ -n "${PIP_INDEX_URL:-}" ] && args+=(-e "PIP_INDEX_URL=$PIP_INDEX_URL")
    say "wheelhouse: pip wheel with the base image's Python"
    docker run "${args[@]}" "$BASE" sh -ec '
        python -c "import tomllib; print(\"\n\".join(tomllib.load(open(\"/src/pyproject.toml\", \"rb\"))[\"project\"][\"dependencies\"]))" > /tmp/deps.txt
        pip wheel -q --disable-pip-version-check -w /wh -c /src/requirements.lock \
            "$0" -r /tmp/deps.txt "setuptools>=68" wheel
        chown -R "$1" /wh' "$TORCH_SPEC" "$(id -u):$(id -g)"
    touch "$WHEELHOUSE/.complete"
    say "wheelhouse: $(ls "$WHEELHOUSE" | wc -l) wheels, $(du -sm "$WHEELHOUSE" | cut -f1) MB"
}

image_inputs() {
    # everything the image is made of: when none changed, the image is not built again
    { docker image inspect -f '{{.Id}}' "$BASE"; echo "$TORCH_SPEC";
      find Dockerfile .dockerignore requirements.lock pyproject.toml README.md services tools \
          -type f -not -path '*/__pycache__/*' -not -name '*.pyc' | LC_ALL=C sort | xargs sha256sum;
    } | sha256sum | cut -c1-16
}

free_port() {
    # the wheelhouse's port is part of the build's arguments, so of Docker's layer cache: the
    # same one each time (SPOTRL_WHEELHOUSE_PORT) unless it is taken
    python3 - "${SPOTRL_WHEELHOUSE_PORT:-47913}" <<'PY'
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
PY
}

build_image() {
    local port server inputs
    inputs=$(image_inputs)
    if [ "$(docker image inspect -f '{{index .Config.Labels "org.spotrl.inputs"}}' "$IMAGE" 2>/dev/null)" = "$inputs" ]; then
        say "image $IMAGE: present, inputs unchanged ($inputs)"
        return
    fi
    port=$(free_port)
    python3 -m http.server "$port" --bind 127.0.0.1 --directory "$WHEELHOUSE" >/dev/null 2>&1 &
    server=$!
    trap 'kill "$server" 2>/dev/null || true' RETURN
    for _ in $(seq 50); do
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/', timeout=1)" 2>/dev/null && break
        sleep 0.1
    done
    say "image $IMAGE: docker build, pip reading only http://127.0.0.1:$port/"
    DOCKER_BUILDKIT=0 docker build -q --network host \
        --build-arg BASE_IMAGE="$BASE" \
        --build-arg PIP_NO_INDEX=1 \
        --build-arg PIP_FIND_LINKS="http://127.0.0.1:$port/" \
        --build-arg TORCH_SPEC="$TORCH_SPEC" \
        --label "org.spotrl.inputs=$inputs" \
        -t "$IMAGE" . >/dev/null
    say "image $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%d MB", $1/1e6}')"
}

mkdir -p "$CACHE"
build_base
build_wheelhouse
build_image
echo "SPOTRL_IMAGE=$IMAGE SPOTRL_REDIS_IMAGE=$BASE docker compose up -d"
