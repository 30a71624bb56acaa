"""`omrl bench evaluator`: what the evaluator (on by default: learner.eval_tasks held-out tasks
every learner.eval_every versions, on an engine of its own) costs training. The default run
(`omrl run`: 2 actors, letters) with the evaluator against the same run without it
(`learner.eval_every = 0`), alternated, run by run in the same repetition.

Per run, over the steps after the first fifth (vLLM's start-up left out, as in the pipeline
benchmark): groups trained per second, the learner's own step time (its step less its wait
for groups), and how many evaluations reached the learner's records. Where the evaluator has a
device of its own (a GPU that no learner rank and no actor uses) nothing is shared; on a
machine of a few CPU cores its engine takes cores from the actors while it evaluates, and
this measures that share.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import omrl_run, pyplot, row
from benchmarks.pipeline import figures
from common.cli import override
from common.config import Config

STEPS, REPEATS = 100, 3
# quick: a smoke run of the code, one actor a run (each actor starts a vLLM engine)
QUICK = {"steps": 4, "eval_every": 2, "eval_tasks": 4, "actors": 1}
SETTINGS = ["run.log_level=WARNING", "run.plot_every_s=0"]


def run_one(root: Path, name: str, sets: list[str], steps: int) -> dict:
    from common.metrics import read_jsonl

    started = time.monotonic()
    run_dir = omrl_run(root, name, [*SETTINGS, *sets], steps)
    result = figures(run_dir)
    evals = {r["eval/version"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/version" in r}
    result.update(name=name, wall_s=time.monotonic() - started, evaluations=len(evals),
                  eval_seconds=[r["eval/seconds"] for r in evals.values()])
    print(f"evaluator {name:<14} groups/s {result['groups_per_s']:6.2f}  learner step {result['learner_step_s']:.3f} s  "
          f"evaluations {result['evaluations']}  reward {result['reward_last_fifth']:.3f}  ({result['wall_s']:.0f} s)",
          flush=True)
    return result


def run(quick: bool, device: str = "cpu") -> dict:
    steps, repeats = (QUICK["steps"], 1) if quick else (STEPS, REPEATS)
    on = [override("learner.eval_every", QUICK["eval_every"]), override("learner.eval_tasks", QUICK["eval_tasks"])] \
        if quick else []  # the defaults
    arms = {"evaluator": on, "none": [override("learner.eval_every", 0)]}
    if quick:
        arms = {arm: [*sets, override("actor.num_actors", QUICK["actors"])] for arm, sets in arms.items()}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="omrl-bench-evaluator-") as tmp:
        for rep in range(repeats):  # the two arms in turn: a slow spell falls on both
            for arm, sets in arms.items():
                runs[arm].append(run_one(Path(tmp), f"{arm}-r{rep}", sets, steps))
    with_, without = runs["evaluator"], runs["none"]
    defaults = Config().learner
    return {"steps": steps, "repeats": repeats, "runs": runs,
            "eval_every": QUICK["eval_every"] if quick else defaults.eval_every,
            "eval_tasks": QUICK["eval_tasks"] if quick else defaults.eval_tasks,
            "rows": [row("default run: groups trained/s, with the evaluator vs without",
                         [r["groups_per_s"] for r in with_], [r["groups_per_s"] for r in without]),
                     row("default run: the learner's own steps/s, with the evaluator vs without",
                         [1 / r["learner_step_s"] for r in with_], [1 / r["learner_step_s"] for r in without])]}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, arm in enumerate(("none", "evaluator")):
        values = [r["groups_per_s"] for r in result["runs"][arm]]
        ax.scatter([i] * len(values), values, label=arm)
    ax.set_xticks([0, 1], ["no evaluator", f"evaluator (every {result['eval_every']} versions)"])
    ax.set_ylabel("groups trained / s")
    ax.set_title(f"the default run, {result['steps']} steps, {result['repeats']} repetitions")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
