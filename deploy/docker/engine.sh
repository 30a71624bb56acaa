#!/usr/bin/env bash
# Makes a Docker engine and docker compose answer on a Debian or Ubuntu machine where none
# does, as root: installs Debian's docker.io, docker-compose (v1) and debootstrap (for the
# local base image), and starts dockerd by hand (no init system needed). Does nothing where
# both already answer. CI runs it so that the `docker` tests run; it says why when it cannot.
set -uo pipefail
have_compose() { docker compose version >/dev/null 2>&1 || docker-compose version >/dev/null 2>&1; }
if docker info >/dev/null 2>&1 && have_compose; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "no Docker engine, and no way to install one here (needs root and apt-get)" >&2
    exit 1
fi
if ! command -v dockerd >/dev/null || ! have_compose || ! command -v debootstrap >/dev/null; then
    echo "installing docker.io, docker-compose and debootstrap from Debian's packages"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose debootstrap; } \
        >/tmp/omrl-docker-install.log 2>&1 || { echo "install failed: see /tmp/omrl-docker-install.log" >&2; exit 1; }
fi
if ! docker info >/dev/null 2>&1; then
    nohup dockerd >/var/log/omrl-dockerd.log 2>&1 &
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
fi
docker info >/dev/null 2>&1 || { echo "dockerd did not start: see /var/log/omrl-dockerd.log" >&2; exit 1; }
echo "Docker engine $(docker version -f '{{.Server.Version}}') is up"
