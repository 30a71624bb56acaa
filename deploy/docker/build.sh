#!/usr/bin/env bash
# Builds the image the compose file runs (openmanus-rl:cpu, or :gpu with OMRL_EXTRA=gpu).
#   bash deploy/docker/build.sh
#   OMRL_BASE_IMAGE=local bash deploy/docker/build.sh   no registry: builds omrl-base:bookworm
#                        from Debian's packages first, and omrl-redis:7 from it (for the compose
#                        file's redis service: export OMRL_REDIS_IMAGE=omrl-redis:7)
#   OMRL_BASE_IMAGE=IMAGE     any other base with Python 3.11 and apt (default python:3.11-slim)
#   OMRL_EXTRA=gpu            upstream vLLM and its CUDA torch
# pip inside the build honours this machine's PIP_CERT (a CA bundle) and takes the CPU torch
# from PIP_FIND_LINKS where a wheel of it lies there; otherwise from the PyTorch CPU index.
set -euo pipefail
cd "$(dirname "$0")/../.."
extra=${OMRL_EXTRA:-cpu}
base=${OMRL_BASE_IMAGE:-python:3.11-slim}
tag=${OMRL_IMAGE:-openmanus-rl:$extra}
command -v docker >/dev/null || { echo "error: no docker command: install a Docker engine (apt-get install docker.io)" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "error: no Docker engine answers: start one (dockerd, or systemctl start docker)" >&2; exit 1; }
if [ "$base" = local ]; then
    base=omrl-base:bookworm
    docker image inspect "$base" >/dev/null 2>&1 || bash deploy/docker/base-image.sh "$base"
    DOCKER_BUILDKIT=0 docker build -q -f deploy/docker/Dockerfile.redis --build-arg BASE_IMAGE="$base" \
        -t omrl-redis:7 deploy/docker >/dev/null
    echo "built omrl-redis:7 (Debian's redis-server): export OMRL_REDIS_IMAGE=omrl-redis:7"
fi
extras=deploy/docker/extras
find "$extras" -mindepth 1 ! -name README.md -delete
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
    cp "$PIP_CERT" "$extras/ca.crt"
fi
if [ "$extra" = cpu ]; then
    for dir in ${PIP_FIND_LINKS:-}; do
        for wheel in "$dir"/torch-2.13.0+cpu-*.whl; do
            [ -f "$wheel" ] && cp "$wheel" "$extras/"
        done
    done
fi
start=$(date +%s)
DOCKER_BUILDKIT=0 docker build -f deploy/docker/Dockerfile --build-arg BASE_IMAGE="$base" \
    --build-arg OMRL_EXTRA="$extra" -t "$tag" .
find "$extras" -mindepth 1 ! -name README.md -delete
echo "built $tag from $base in $(( $(date +%s) - start )) s"
