"""A user's own package, outside the repository, extends a run through `run.plugins`: it
registers an env, an action template and an async reward function that reads the task file's
own column and the episode's turns. `omrl run` imports it in every process (the checks before
start, the env server, the actor, the learner) and trains on it; groups whose reward function
fails are failed with its reason, never trained with a reward of 0."""

import json
import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.metrics import read_jsonl
from tests.budget import patience

PLUGIN = '''
"""An extension of OpenManus-RL that lives in its own package."""
import asyncio

from actors.templates import ActionTemplate, register_template
from envs.base import Env, StepResult, register_env
from envs.rewards import register_reward


@register_env("echo")
class Echo(Env):
    """Say the task's word back, twice."""

    def reset(self, task_idx):
        self.word, self.turn = "abcd"[task_idx % 4], 0
        return f"Say {self.word}"

    def step(self, action):
        self.turn += 1
        return StepResult(f"Say {self.word}", float(action == self.word) / 2, self.turn >= 2)


@register_template("first_char")
class FirstChar(ActionTemplate):
    instructions = ""

    def parse(self, text):
        return text.strip()[:1] or None


@register_reward("answer_seen")
async def answer_seen(episode):
    """10 when the episode carries its task file's answer, its prompt and every turn; fails on 'boom'."""
    await asyncio.sleep(0.001)  # an async reward: a judge would call a service here
    answer = episode.task["answer"]
    if answer == "boom":
        raise ValueError(f"no verdict for task {episode.task_idx}")
    assert answer == f"answer-{episode.task_idx}" and episode.prompt.startswith("Say ")
    assert len(episode.turns) == len(episode.turn_rewards) >= 1
    return 10.0
'''


def write_tasks(out):
    """Train tasks 0-19 (the odd ones' reward fails), test tasks 20-23, each with an `answer` column."""
    out.mkdir()
    for split, indices in (("train", range(20)), ("test", range(20, 24))):
        pq.write_table(pa.table({
            "env": ["echo"] * len(indices), "task_idx": list(indices), "split": [split] * len(indices),
            "answer": ["boom" if i % 2 else f"answer-{i}" for i in indices]}), out / f"{split}.parquet")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.redis
@pytest.mark.timeout(patience(65))
def test_a_package_of_our_own_trains_end_to_end(tmp_path):
    package = tmp_path / "site" / "my_omrl_ext"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    write_tasks(tmp_path / "tasks")
    run_dir = tmp_path / "run"
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "run", "--run-dir", str(run_dir), "--steps", "3",
         "--set", 'run.plugins=["my_omrl_ext"]', "--set", 'env.name="echo"', "--set", f"env.tasks={json.dumps(str(tmp_path / 'tasks'))}",
         "--set", 'actor.action_template="first_char"', "--set", "actor.rewards={env = 1.0, answer_seen = 1.0}",
         "--set", "actor.num_actors=1", "--set", "learner.groups_per_step=4", "--set", "actor.group_size=2",
         "--set", "actor.concurrent_groups=2", "--set", "learner.eval_every=0"],
        capture_output=True, text=True, timeout=patience(60), env=environ)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Every trained episode got the plugin's 10 on top of the env's reward (0 to 1).
    assert all(10.0 <= r["reward/mean"] <= 11.0 for r in rows), [r["reward/mean"] for r in rows]
    books = json.loads((run_dir / "accounting.json").read_text())
    assert books["trained"] == 12 and books["dead_lettered"] == {}, books
    # Half the train tasks' reward function fails: those groups failed with its reason, none trained.
    assert books["failed"].get("reward_error", 0) >= 1 and set(books["failed"]) <= {"reward_error", "cancelled"}, books
    actor_log = (run_dir / "logs" / "actor0.log").read_text()
    assert "reward function 'answer_seen' on task" in actor_log and "ValueError: no verdict for task" in actor_log
