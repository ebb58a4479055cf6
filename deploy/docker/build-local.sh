#!/usr/bin/env bash
# Build the splitserve image where no container registry can be reached: the base image is
# made from Debian's packages (debootstrap), and the image is built with podman (no daemon).
#
#   deploy/docker/build-local.sh [TAG]        # default localhost/splitserve:dev
#
# Needs root, podman and debootstrap (apt-get install podman debootstrap), Debian's mirror
# and PyPI. Passes on to the build what this host uses to reach PyPI: its CA bundle (for a
# proxy that intercepts TLS) and, when pip's find-links names one, a folder of wheels
# (a torch CPU wheel on disk). With a registry, plain `docker build` needs none of this.
set -euo pipefail

TAG=${1:-localhost/splitserve:dev}
BASE=${SPLITSERVE_BASE_IMAGE:-localhost/splitserve-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)

# This machine's limits cannot be raised (no CAP_SYS_RESOURCE), and podman raises
# RLIMIT_NOFILE / RLIMIT_NPROC by default: ask for lower ones. Builds run chroot-isolated
# (no cgroups: this host's hybrid cgroup layout is refused by crun).
BUILD_OPTS=(--isolation chroot --network host --format docker)

if ! podman image exists "$BASE"; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "base image $BASE: debootstrap bookworm from $MIRROR"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$work/rootfs" "$MIRROR" > "$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log"; exit 1; }
    ln -sf python3 "$work/rootfs/usr/bin/python"  # the Dockerfile calls `python`, as python:3.11-slim has it
    rm -rf "$work/rootfs/var/cache/apt/archives"/*.deb "$work/rootfs/var/lib/apt/lists"/*
    tar -C "$work/rootfs" -c . | podman import --change 'CMD ["python3"]' - "$BASE" > /dev/null
    rm -rf "$work"
    trap - EXIT
fi

args=(--build-arg "BASE_IMAGE=$BASE")
# pip's own settings, from its environment variables or its config files.
pip_setting() {
    local var=$1 key=$2
    if [ -n "${!var:-}" ]; then echo "${!var}"; return; fi
    python3 -m pip config get "global.$key" 2>/dev/null || true
}
cert=$(pip_setting PIP_CERT cert)
cert=${cert:-/etc/ssl/certs/ca-certificates.crt}
if [ -f "$cert" ]; then
    args+=(-v "$cert:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
fi
links=$(pip_setting PIP_FIND_LINKS find-links)
if [ -n "$links" ] && [ -d "$links" ]; then
    # pip takes torch from this folder when it holds torch==2.13.0 (a CPU build sorts above
    # the registry's plain 2.13.0); the rest comes from PyPI.
    args+=(-v "$links:/run/wheels:ro" --build-arg PIP_FIND_LINKS=/run/wheels
           --build-arg TORCH_INDEX_URL=https://pypi.org/simple)
fi

cd "$ROOT"
podman build "${BUILD_OPTS[@]}" "${args[@]}" -f deploy/docker/Dockerfile -t "$TAG" .
echo "built $TAG"
