#!/usr/bin/env bash
# Builds a Debian base image with Python 3.11 (and its headers: torch compiles CPU kernels)
# from Debian's packages, for machines that reach Debian's archive but no container registry.
# Needs root and debootstrap.
#   bash deploy/docker/base-image.sh [TAG]          (default omrl-base:bookworm)
#   OMRL_DEBIAN_MIRROR=URL                          an archive other than this machine's apt source
# Then: OMRL_BASE_IMAGE=omrl-base:bookworm bash deploy/docker/build.sh
set -euo pipefail
tag=${1:-omrl-base:bookworm}
command -v debootstrap >/dev/null || { echo "error: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
# The archive this machine's apt already uses, unless one is named.
apt_archive() {
    grep -h -o -E '^(URIs:|deb) +[^ ]+' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
        | awk '{print $2}' | grep -v security | head -1
}
mirror=${OMRL_DEBIAN_MIRROR:-}
[ -n "$mirror" ] || mirror=$(apt_archive || true)
root=$(mktemp -d /var/tmp/omrl-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm from ${mirror:-the default archive of debootstrap} into $root"
debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates bookworm "$root" ${mirror:+"$mirror"} >/dev/null
# No package caches or lists in the image (apt-get update inside a build fetches them anew).
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' - "$tag" >/dev/null
echo "built $tag ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
