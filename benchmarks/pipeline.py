"""`omrl bench pipeline`: the whole system (`omrl run`: embedded Redis, env server, vLLM
actors, learner, each its own process) on `long_tail`, an env whose answers take 1 to 64
letters, heavy-tailed (most groups end after one short turn, a few run sixteen), run
asynchronously at eta = 1, 2, 4, 8 against the synchronous baseline (`learner.mode =
"sync"`: generate a batch with the current weights, train, publish, only then generate
again) with the same engine, learner, model initialisation and steps.

Per run, over the steps after the first fifth (vLLM's start-up is left out): groups
trained per second, the learner's busy fraction (time not spent waiting for groups), the
actors' idle fraction (time their engine had no generate call in flight, from
RUN_DIR/actors/*.jsonl), the staleness histogram, and the mean reward of the last fifth of
the steps, so speed is compared at equal learning; and the learner's own step time (its
step less its wait for groups), which shows what the actors' load costs it. The ratios
are async over sync, run by run in the same repetition: above 1, asynchrony trains faster
(groups/s) or learns as much (reward).

Two layouts of the processes on the machine's cores: `split` pins the learner to the first
core and the actors (and their engines) to the others (`learner.cpus`, `actor.cpus`), as
devices of their own would in a real deployment; `shared` lets every process run on every
core, so the actors' engines and the learner compete for the same cores. The eta sweep (2
actors, two repetitions) runs split; a sync / eta = 2 pair runs shared; the actor sweep
compares eta = 2 with sync at 1 and 4 actors, split.
"""

from __future__ import annotations

import collections
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import omrl_run, pyplot, row
from common.cli import override

# No evaluator: its engine would take CPU from the measured layouts.
SETTINGS = ["env.name=long_tail", "actor.max_turns=64", "actor.max_seq_len=1024", "run.log_level=WARNING",
            "learner.eval_every=0"]
ETAS = (1, 2, 4, 8)
STEPS = 30
REPEATS = 2  # of the eta sweep and of the shared pair; the actor sweep runs once
ACTOR_SWEEP = (1, 4)
QUICK_STEPS = 3


def mode(eta: int | None) -> list[str]:
    """--set overrides of a configuration: eta None is the synchronous baseline."""
    return [override("learner.mode", "sync")] if eta is None else [override("learner.mode", "async"),
                                                                   override("learner.eta", eta)]


def layout(name: str) -> list[str]:
    """--set overrides that place the processes: split (the learner on the first core of this
    process's, the actors on the others) or shared (no pinning)."""
    if name == "shared":
        return []
    first, *rest = sorted(os.sched_getaffinity(0))
    return [override("learner.cpus", [first]), override("actor.cpus", rest)]


def layouts() -> tuple[str, str]:
    """(the layout of the sweeps, the layout compared with it): split needs two cores."""
    return ("split", "shared") if len(os.sched_getaffinity(0)) >= 2 else ("shared", "shared")


def label(eta: int | None) -> str:
    return "sync" if eta is None else f"eta={eta}"


def run_system(root: Path, name: str, eta: int | None, actors: int, steps: int, cores: str) -> dict:
    """One `omrl run` to `steps` steps with the processes laid out on `cores`; its figures."""
    started = time.monotonic()
    run_dir = omrl_run(root, name, [*SETTINGS, *mode(eta), *layout(cores), override("actor.num_actors", actors)], steps)
    result = figures(run_dir)
    result.update(eta=eta, mode=label(eta), actors=actors, cores=cores, wall_s=time.monotonic() - started)
    print(f"pipeline {name:<24} groups/s {result['groups_per_s']:6.2f}  learner busy {result['learner_busy']:.2f} "
          f"(step {result['learner_step_s']:.2f} s)  actors idle {result['actor_idle']:.2f}  reward "
          f"{result['reward_last_fifth']:.3f}  staleness {result['staleness_mean']:.2f}  ({result['wall_s']:.0f} s)",
          flush=True)
    return result


def figures(run_dir: Path) -> dict:
    """A finished run's figures over the steps after the first fifth."""
    from common.metrics import read_jsonl

    by_step = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}  # a retrained step: the last line
    records = [by_step[s] for s in sorted(by_step)]
    first = max(1, len(records) // 5)
    start, window = records[first - 1], records[first:]
    t0, t1 = start["time"], records[-1]["time"]
    elapsed = t1 - t0
    staleness = collections.Counter()
    for r in records:
        staleness.update({int(k): v for k, v in r["staleness/hist"].items()})
    idle = [1 - (_at(a, t1) - _at(a, t0)) / elapsed
            for a in (read_jsonl(p) for p in sorted((run_dir / "actors").glob("*.jsonl")))]
    rewards = [r["reward/mean"] for r in records]
    groups = sum(staleness.values())
    return {"groups_per_s": sum(r["batch/groups"] for r in window) / elapsed,
            "learner_busy": 1 - sum(r["perf/wait_s"] for r in window) / elapsed,
            "learner_step_s": statistics.median(r["perf/step_s"] - r["perf/wait_s"] for r in window),
            "actor_idle": statistics.mean(idle), "staleness_hist": dict(sorted(staleness.items())),
            "staleness_mean": sum(k * v for k, v in staleness.items()) / groups,
            "rewards": rewards, "reward_last_fifth": statistics.mean(rewards[-max(1, len(rewards) // 5):]),
            "steps": len(records)}


def _at(records: list[dict], t: float) -> float:
    """An actor's generating seconds at wall time t, interpolated between its samples."""
    return float(np.interp(t, [r["time"] for r in records], [r["actor/generating_s"] for r in records]))


def run(quick: bool, device: str = "cpu") -> dict:
    steps = QUICK_STEPS if quick else STEPS
    sweep_cores, other_cores = layouts()
    sweep_actors = 1 if quick else 2
    # (configurations alternated within each repetition, repetitions)
    plan = [([(eta, sweep_actors, sweep_cores) for eta in (None, 1)], 1)] if quick else [
        ([(eta, sweep_actors, sweep_cores) for eta in (None, *ETAS)]
         + [(eta, sweep_actors, other_cores) for eta in (None, 2)], REPEATS),
        ([(eta, actors, sweep_cores) for actors in ACTOR_SWEEP for eta in (None, 2)], 1)]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="omrl-bench-pipeline-") as tmp:
        root = Path(tmp)
        for configs, repeats in plan:
            for rep in range(repeats):
                for eta, actors, cores in configs:
                    name = f"{label(eta)}-a{actors}-{cores}-r{rep}"
                    runs.append({"repeat": rep, **run_system(root, name, eta, actors, steps, cores)})
    rows = []
    for cores in dict.fromkeys(r["cores"] for r in runs):
        for actors in sorted({r["actors"] for r in runs if r["cores"] == cores}):
            for eta in sorted({r["eta"] for r in runs if r["actors"] == actors and r["cores"] == cores} - {None}):
                where = f"{cores} cores, {actors} actors, eta={eta} vs sync"
                rows.append(row(f"{where}: groups trained/s", *_paired(runs, cores, actors, eta, "groups_per_s")))
                if not quick and (cores, actors) == (sweep_cores, sweep_actors):
                    rows.append(row(f"{where}: reward, last fifth of {steps} steps",
                                    *_paired(runs, cores, actors, eta, "reward_last_fifth")))
    return {"runs": runs, "rows": rows, "steps": steps, "settings": SETTINGS, "sweep_actors": sweep_actors,
            "sweep_cores": sweep_cores}


def _paired(runs: list[dict], cores: str, actors: int, eta: int, key: str) -> tuple[list[float], list[float]]:
    """The figure of eta's runs and of the sync runs of the same layout and repetitions."""
    same = [r for r in runs if r["cores"] == cores and r["actors"] == actors]
    mine = {r["repeat"]: r[key] for r in same if r["eta"] == eta}
    sync = {r["repeat"]: r[key] for r in same if r["eta"] is None}
    reps = sorted(mine.keys() & sync.keys())
    return [mine[k] for k in reps], [sync[k] for k in reps]


def plot(result: dict, path) -> None:
    plt = pyplot()
    sweep = [r for r in result["runs"] if r["actors"] == result["sweep_actors"] and r["cores"] == result["sweep_cores"]]
    modes = list(dict.fromkeys(r["mode"] for r in sweep))
    fig, axes = plt.subplots(1, 5, figsize=(25, 4))
    speed, reward, busy, stale, cores = axes
    per_mode = {m: [r for r in sweep if r["mode"] == m] for m in modes}
    speed.bar(modes, [statistics.median(r["groups_per_s"] for r in per_mode[m]) for m in modes],
              color=["grey"] + ["C0"] * (len(modes) - 1))
    for i, m in enumerate(modes):
        speed.plot([i] * len(per_mode[m]), [r["groups_per_s"] for r in per_mode[m]], "k.")
    speed.set_title(f"groups trained/s ({sweep[0]['actors']} actors, {sweep[0]['cores']} cores; dots: runs)")
    for m in modes:
        rewards = np.mean([r["rewards"] for r in per_mode[m]], axis=0)
        reward.plot(range(1, len(rewards) + 1), rewards, label=m, lw=2 if m == "sync" else 1)
    reward.set_title("reward per step (mean over repetitions)")
    reward.set_xlabel("learner step")
    reward.legend(fontsize=8)
    x = np.arange(len(modes))
    busy.bar(x - 0.2, [statistics.median(r["learner_busy"] for r in per_mode[m]) for m in modes], 0.4,
             label="learner busy")
    busy.bar(x + 0.2, [statistics.median(r["actor_idle"] for r in per_mode[m]) for m in modes], 0.4,
             label="actor idle")
    busy.set_xticks(x, modes)
    busy.set_ylim(0, 1)
    busy.set_title("time fractions")
    busy.legend(fontsize=8)
    for j, m in enumerate(modes):
        hist = collections.Counter()
        for r in per_mode[m]:
            hist.update({int(k): v for k, v in r["staleness_hist"].items()})
        total = sum(hist.values())
        ks = sorted(hist)
        stale.bar(np.array(ks) + (j - (len(modes) - 1) / 2) * 0.15, [hist[k] / total for k in ks], 0.15, label=m)
    stale.set_title("staleness of trained groups (optimizer steps)")
    stale.set_ylabel("share of groups")
    stale.legend(fontsize=8)
    plot_layouts(cores, [r for r in result["runs"] if r["actors"] == result["sweep_actors"] and r["eta"] in (None, 2)])
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_layouts(ax, runs: list[dict]) -> None:
    """groups/s of sync and eta=2 per layout, each bar labelled with the learner's own step time."""
    bars = list(dict.fromkeys((r["cores"], r["mode"]) for r in runs))
    for i, (cores, mode_) in enumerate(bars):
        mine = [r for r in runs if (r["cores"], r["mode"]) == (cores, mode_)]
        ax.bar(i, statistics.median(r["groups_per_s"] for r in mine), color="grey" if mode_ == "sync" else "C0")
        ax.text(i, 0, f"learner step\n{statistics.median(r['learner_step_s'] for r in mine):.2f} s", ha="center",
                va="bottom", fontsize=8, color="white")
    ax.set_xticks(range(len(bars)), [f"{mode_}\n{cores} cores" for cores, mode_ in bars])
    ax.set_title("groups trained/s by layout")
