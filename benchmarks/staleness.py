"""`omrl bench staleness`: does asynchrony reach a given success sooner, without learning
worse, and which off-policy correction holds learning as the data gets staler?

The same built-in env (`grid_nav`, the suite env learned furthest from its observations) is
trained through `omrl run` for the same number of optimizer steps in each arm, with the
learner on a core of its own and the actors (and their engines) on the rest, as devices of
their own would have them (the split layout of `omrl bench pipeline`):

- `sync`: the synchronous baseline (`learner.mode = "sync"`, staleness 0);
- `decoupled eta=E` for E = 1, 2, 4, 8: AReaL's decoupled PPO (the ratio against the
  learner's weights before the batch's first update, the behaviour tokens weighted by a
  capped importance weight);
- `naive eta=4`, `naive eta=8`: PPO's ratio against the behaviour policy, as if the data
  were fresh;
- `tis eta=4`: the truncated, masked importance-sampled policy gradient (PipelineRL, verl's
  rollout correction);
- `decoupled eta=4, 1 update`: the old default (one update per batch: the decoupled loss's
  clip never acts), to choose the trust region by measurement;
- `decoupled eta=4, lr/4`: four minibatch updates at a quarter of the learning rate (below),
  paired with `sync, lr/4`, the synchronous baseline at that learning rate (added with it).

Every arm but the one-update one runs `learner.minibatches = 4` (four optimizer steps per batch, the
proximal pass before the first: AReaL's setting, where the clip acts). Seeds run in turn
(every arm on seed 0, then seed 1, ...), so a study stopped early is balanced.

The criterion, fixed before any run (issue 26): each run's final success is the mean of
`reward/success` over its last fifth of steps; its time to target is the wall time since
its first step at which the trailing 8-step mean of `reward/success` first reaches TARGET
(never: censored, counted apart). Per arm: the mean final success with a 95% t-interval
over seeds, and the paired difference against sync seed by seed with its own interval.
The goals: decoupled at eta 4 within 5% of sync's final success; naive visibly worse than
sync at eta 8 (its paired difference's interval below 0); async reaching the target in at
most 0.6x sync's wall time (median over seeds of the paired ratio). The default trust region
follows from `decoupled eta=4` (4 minibatches) against `decoupled eta=4, 1 update`: four
minibatch updates become the default unless the paired difference's 95% interval lies wholly
below 0 (the trust region clearly worse); the extra proximal forward's cost is reported, not
weighed (fixed before the eta = 4 runs, commit of this line).

A follow-up arm, added after the five seeds of the arms above (four updates at the same
learning rate ended below one update at eta 4, -0.21 [-0.50, 0.08], and the default job's
entropy collapsed under them): `decoupled eta=4, lr/4`, four minibatch updates at a quarter
of the learning rate, about one update's movement a batch but clipped. Its rule, fixed before
its runs: four minibatches at a quarter of the learning rate become the default if its mean
paired difference in final success against `decoupled eta=4, 1 update` is at least -0.05;
otherwise the default stays at one update a batch, with no trust region on by default.

With OMRL_BENCH_RUNS=DIR every finished run's figures are kept as DIR/NAME.json and a run
found there is not run again: a study stopped part-way goes on where it stopped.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import omrl_run, pyplot, row
from benchmarks.pipeline import layout, layouts
from common.cli import override
from common.stats import T975, interval

# No evaluator: its engine would take CPU from the arms' time to target.
SETTINGS = ["env.name=grid_nav", "actor.max_tokens=1", "actor.max_turns=8", "run.log_level=WARNING",
            "learner.eval_every=0"]
TRUST_REGION = {"learner.minibatches": 4}  # every arm's but the one-update one
# (name, learner fields): the arms, in the order each seed runs them
ARMS = [
    ("sync", {"learner.mode": "sync", "learner.loss": "decoupled"}),
    *[(f"decoupled eta={e}", {"learner.eta": e, "learner.loss": "decoupled"}) for e in (1, 2, 4, 8)],
    *[(f"naive eta={e}", {"learner.eta": e, "learner.loss": "naive"}) for e in (4, 8)],
    ("tis eta=4", {"learner.eta": 4, "learner.loss": "tis"}),
    ("decoupled eta=4, 1 update", {"learner.eta": 4, "learner.loss": "decoupled", "learner.minibatches": 1}),
    ("decoupled eta=4, lr/4", {"learner.eta": 4, "learner.loss": "decoupled", "learner.lr": 2.5e-4}),
    ("sync, lr/4", {"learner.mode": "sync", "learner.loss": "decoupled", "learner.lr": 2.5e-4}),
]


def baseline(arm: str) -> str:
    """The sync arm an arm is paired with: the one at its learning rate."""
    return "sync, lr/4" if arm.endswith("lr/4") and arm != "sync, lr/4" else "sync"

SEEDS = (0, 1, 2, 3, 4)
STEPS = 80
TARGET = 0.6  # trailing mean of reward/success to reach (fixed before the runs)
SMOOTH = 8  # steps in that trailing mean, and in the plots'
# quick: a smoke run of the code, one actor a run (each actor starts a vLLM engine)
QUICK = {"arms": ("sync", "naive eta=4"), "seeds": (0,), "steps": 3, "actors": 1}


def settings(arm: str, seed: int) -> list[str]:
    fields = {"learner.mode": "async", **TRUST_REGION, **dict(ARMS)[arm], "learner.seed": seed,
              "actor.seed": 100 * seed}
    return [*SETTINGS, *layout(layouts()[0]), *(override(k, v) for k, v in fields.items())]


def trailing(values: list[float], k: int = SMOOTH) -> np.ndarray:
    """The mean of each value and the k - 1 before it (fewer at the start)."""
    c = np.cumsum(np.concatenate([[0.0], values]))
    n = np.arange(1, len(values) + 1)
    lo = np.maximum(0, n - k)
    return (c[n] - c[lo]) / (n - lo)


def run_name(arm: str, seed: int) -> str:
    """A run's file name: "decoupled eta=4, lr/4", seed 2 -> decoupledeta4-lrover4-s2."""
    return f"{arm.replace(' ', '').replace(',', '-').replace('=', '').replace('/', 'over')}-s{seed}"


def figures(run_dir: Path, window: int) -> dict:
    """A finished run's figures; its final success is the mean over its last `window` steps."""
    from common.metrics import read_jsonl

    by_step = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}  # a retrained step: the last line
    records = [by_step[s] for s in sorted(by_step)]
    success = [r["reward/success"] for r in records]
    times = [r["time"] - records[0]["time"] for r in records]
    reached = np.flatnonzero(trailing(success) >= TARGET)
    hist = collections.Counter()
    for r in records:
        hist.update({int(k): v for k, v in r["staleness/hist"].items()})
    return {"success": success, "rewards": [r["reward/mean"] for r in records], "times": times,
            "final_success": statistics.mean(success[-window:]),
            "final_reward": statistics.mean(r["reward/mean"] for r in records[-window:]),
            "time_to_target": times[reached[0]] if reached.size else None,
            "steps_to_target": int(reached[0]) + 1 if reached.size else None,
            "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
            "staleness_mean": sum(k * v for k, v in hist.items()) / max(1, sum(hist.values())),
            "staleness_max": max(hist, default=0),
            "frac_clipped": statistics.mean(r.get("learner/frac_clipped", 0.0) for r in records),
            "ess": statistics.mean(r.get("learner/ess", 1.0) for r in records),
            "step_s": statistics.median(r["perf/step_s"] for r in records[len(records) // 5:])}


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent)
    return done.stdout.strip() or "unknown"


def run(quick: bool, device: str = "cpu") -> dict:
    arms, seeds, steps = (QUICK["arms"], QUICK["seeds"], QUICK["steps"]) if quick else \
        ([name for name, _ in ARMS], SEEDS, STEPS)
    keep = Path(os.environ["OMRL_BENCH_RUNS"]) if os.environ.get("OMRL_BENCH_RUNS") and not quick else None
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="omrl-bench-staleness-") as tmp:
        for seed in seeds:  # every arm once per seed, in turn
            for arm in arms:
                name = run_name(arm, seed)
                kept = keep / f"{name}.json" if keep else None
                if kept is not None and kept.exists():
                    runs.append(json.loads(kept.read_text()))
                    continue
                started = time.monotonic()
                # quick: every step counts (a few steps of an untrained model may all score 0)
                sets = [*settings(arm, seed), *([override("actor.num_actors", QUICK["actors"])] if quick else [])]
                result = figures(omrl_run(Path(tmp), name, sets, steps),
                                 steps if quick else max(1, steps // 5))
                result.update(arm=arm, seed=seed, wall_s=time.monotonic() - started, commit=commit())
                runs.append(result)
                if kept is not None:
                    kept.parent.mkdir(parents=True, exist_ok=True)
                    kept.write_text(json.dumps(result) + "\n")
                target = "never" if result["time_to_target"] is None else f"{result['time_to_target']:.0f} s"
                print(f"staleness {name:<22} success (last fifth) {result['final_success']:.3f}  target {target}  "
                      f"staleness {result['staleness_mean']:.2f} (max {result['staleness_max']})  clipped "
                      f"{result['frac_clipped']:.3f}  ess {result['ess']:.2f}  ({result['wall_s']:.0f} s)", flush=True)
    result = report(runs, steps, list(arms))
    print(result["table"], flush=True)
    return result


def report(runs: list[dict], steps: int, arms: list[str]) -> dict:
    """The study's result from its runs (every arm's, for the seeds there are)."""
    result = {"runs": runs, "steps": steps, "settings": SETTINGS, "trust_region": TRUST_REGION, "target": TARGET,
              "seeds": sorted({r["seed"] for r in runs}), "arms": arms}
    result["rows"] = rows(result)
    result["summary"] = summary(result)
    result["trust_region"] = trust_region(result)
    result["table"] = table(result)
    return result


def trust_region(result: dict) -> dict | None:
    """The rule for the default: 4 minibatches against one update at eta 4, seed by seed (final
    success, 4 minibatches less one update, with its 95% interval)."""
    by = _by(result)
    mine, one = by.get("decoupled eta=4", {}), by.get("decoupled eta=4, 1 update", {})
    seeds = sorted(set(mine) & set(one))
    if not seeds:
        return None
    diff = interval([mine[s]["final_success"] - one[s]["final_success"] for s in seeds])
    out = {"seeds": len(seeds), "minibatches_less_one_update": diff,
           "keep_minibatches": bool(np.isnan(diff[2]) or diff[2] >= 0)}
    quarter = by.get("decoupled eta=4, lr/4", {})
    both = sorted(set(quarter) & set(one))
    if both:  # the follow-up's rule: its mean paired difference at least -0.05
        diff = interval([quarter[s]["final_success"] - one[s]["final_success"] for s in both])
        out.update(quarter_lr_less_one_update=diff, quarter_lr_default=bool(diff[0] >= -0.05))
    return out


def _by(result: dict) -> dict[str, dict[int, dict]]:
    """arm -> seed -> run."""
    out: dict[str, dict[int, dict]] = {arm: {} for arm in result["arms"]}
    for r in result["runs"]:
        out[r["arm"]][r["seed"]] = r
    return out


def rows(result: dict) -> list[dict]:
    """Per async arm, seed by seed against sync: optimizer steps per second, final success and
    time to the target (sync's time over the arm's, above 1 when the arm is faster; seeds where
    either never reached it left out)."""
    by = _by(result)
    out = []
    for arm in result["arms"][1:]:
        base_arm = baseline(arm)
        sync = by[base_arm]
        seeds = sorted(set(by[arm]) & set(sync))
        if seeds:
            out.append(row(f"{arm} vs {base_arm}: optimizer steps per second", [1 / by[arm][s]["step_s"] for s in seeds],
                           [1 / sync[s]["step_s"] for s in seeds]))
        mine = [by[arm][s]["final_success"] for s in seeds]
        base = [sync[s]["final_success"] for s in seeds]
        if seeds and min(mine) > 0 and min(base) > 0:
            out.append(row(f"{arm} vs {base_arm}: success, last fifth of {result['steps']} steps", mine, base))
        both = [s for s in seeds if by[arm][s]["time_to_target"] and sync[s]["time_to_target"]]
        if both:
            out.append(row(f"{arm} vs {base_arm}: 1 / seconds to success {result['target']}",
                           [1 / by[arm][s]["time_to_target"] for s in both],
                           [1 / sync[s]["time_to_target"] for s in both]))
    return out


def summary(result: dict) -> dict[str, dict]:
    """Per arm: final success with its interval, the paired difference against sync with its
    interval, time to target, and what the loss and the staleness did."""
    by = _by(result)
    out = {}
    for arm in result["arms"]:
        runs = [by[arm][s] for s in sorted(by[arm])]
        if not runs:
            continue
        sync = by[baseline(arm)]
        paired = sorted(set(by[arm]) & set(sync))
        diff = [by[arm][s]["final_success"] - sync[s]["final_success"] for s in paired]
        times = [r["time_to_target"] for r in runs if r["time_to_target"] is not None]
        ratio = [by[arm][s]["time_to_target"] / sync[s]["time_to_target"] for s in paired
                 if by[arm][s]["time_to_target"] and sync[s]["time_to_target"]]
        hist = collections.Counter()
        for r in runs:
            hist.update({int(k): v for k, v in r["staleness_hist"].items()})
        out[arm] = {"seeds": len(runs), "final_success": interval([r["final_success"] for r in runs]),
                    "vs_sync": interval(diff) if diff else None,
                    "reached": len(times), "time_to_target_median": statistics.median(times) if times else None,
                    "time_ratio_median": statistics.median(ratio) if ratio else None,
                    "steps_to_target_median": statistics.median(
                        [r["steps_to_target"] for r in runs if r["steps_to_target"]] or [float("nan")]),
                    "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
                    "staleness_mean": statistics.mean(r["staleness_mean"] for r in runs),
                    "frac_clipped": statistics.mean(r["frac_clipped"] for r in runs),
                    "ess": statistics.mean(r["ess"] for r in runs),
                    "step_s": statistics.median(r["step_s"] for r in runs),
                    "wall_s": statistics.median(r["wall_s"] for r in runs)}
    return out


def _ci(t) -> str:
    mean, lo, hi = t
    return f"{mean:.3f}" if np.isnan(lo) else f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"


def table(result: dict) -> str:
    """Markdown: per arm, final success and its difference from sync with 95% intervals, time
    to the target, and what the staleness and the loss did."""
    lines = [f"| arm | seeds | success, last fifth [95% CI] | minus sync at its lr, paired [95% CI] | reached {result['target']} "
             f"| seconds to it (median) | / sync's (median) | staleness mean | clipped | ESS |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, s in result["summary"].items():
        secs = "-" if s["time_to_target_median"] is None else f"{s['time_to_target_median']:.0f}"
        ratio = "-" if s["time_ratio_median"] is None or arm == "sync" else f"x{s['time_ratio_median']:.2f}"
        vs = "-" if arm == "sync" or s["vs_sync"] is None else _ci(s["vs_sync"])
        lines.append(f"| {arm} | {s['seeds']} | {_ci(s['final_success'])} | {vs} | {s['reached']}/{s['seeds']} | "
                     f"{secs} | {ratio} | {s['staleness_mean']:.2f} | {s['frac_clipped']:.3f} | {s['ess']:.2f} |")
    return "\n".join(lines) + "\n"


def _band(runs: list[dict], x_of) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x, mean and 95% band over seeds of the trailing success, on x_of(run)'s axis."""
    n = min(len(r["success"]) for r in runs)
    curves = np.array([trailing(r["success"][:n]) for r in runs])
    xs = np.array([x_of(r)[:n] for r in runs])
    grid = np.linspace(xs[:, 0].max(), xs[:, -1].min(), 100) if xs.shape[0] > 1 else xs[0]
    ys = np.array([np.interp(grid, x, c) for x, c in zip(xs, curves)])
    mean = ys.mean(0)
    half = T975.get(len(runs) - 1, 1.96) * ys.std(0, ddof=1) / len(runs) ** 0.5 if len(runs) > 1 else 0 * mean
    return grid, mean, mean - half, mean + half


def plot(result: dict, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    (by_step, by_time), (final, hist) = axes
    by = _by(result)
    arms = [a for a in result["arms"] if by[a]]
    for i, arm in enumerate(arms):
        runs = list(by[arm].values())
        style = dict(color="black" if arm == "sync" else f"C{i}", ls="--" if "naive" in arm else "-",
                     lw=2 if arm == "sync" else 1.2)
        for ax, x_of in ((by_step, lambda r: np.arange(1, len(r["success"]) + 1)), (by_time, lambda r: r["times"])):
            x, mean, lo, hi = _band(runs, lambda r: np.asarray(x_of(r), dtype=float))
            ax.plot(x, mean, label=f"{arm} ({len(runs)})", **style)
            ax.fill_between(x, lo, hi, color=style["color"], alpha=0.12)
        s = result["summary"][arm]
        mean, lo, hi = s["final_success"]
        final.bar(i, mean, color=style["color"], alpha=0.7, hatch="//" if "naive" in arm else None)
        if not np.isnan(lo):
            final.errorbar(i, mean, yerr=[[mean - lo], [hi - mean]], color="k", capsize=4)
        final.plot([i] * len(runs), [r["final_success"] for r in runs], "k.")
        counts = {int(k): v for k, v in s["staleness_hist"].items()}
        total = sum(counts.values())
        ks = sorted(counts)
        hist.plot(ks, [counts[k] / total for k in ks], marker="o", label=arm, **style)
    for ax in (by_step, by_time):
        ax.axhline(result["target"], color="grey", lw=0.8, ls=":")
        ax.set_ylabel(f"success ({SMOOTH}-step trailing mean; band: 95% CI over seeds)")
    by_step.set_xlabel("learner step")
    by_step.set_title("success against optimizer steps")
    by_time.set_xlabel("seconds since the first step")
    by_time.set_title("success against wall time")
    final.set_xticks(range(len(arms)), [a.replace(" ", "\n") for a in arms], fontsize=8)
    final.set_title(f"success, last fifth of {result['steps']} steps (95% CI; dots: seeds)")
    hist.set_xlabel("staleness of a trained group (optimizer steps)")
    hist.set_ylabel("share of groups")
    hist.set_title("staleness")
    for ax in (by_step, by_time, final, hist):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    hist.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    """`python -m benchmarks.staleness DIR OUT`: the report of the runs a study kept in DIR
    (OMRL_BENCH_RUNS) so far, seeds every arm has run, as OUT/staleness.json and .png."""
    import sys

    kept, out = Path(sys.argv[1]), Path(sys.argv[2])
    runs = [json.loads(p.read_text()) for p in sorted(kept.glob("*.json"))]
    complete = [s for s in sorted({r["seed"] for r in runs}) if sum(r["seed"] == s for r in runs) == len(ARMS)]
    runs = [r for r in runs if r["seed"] in complete]
    arms = [name for name, _ in ARMS]
    runs.sort(key=lambda r: (r["seed"], arms.index(r["arm"])))
    result = report(runs, STEPS, arms)
    out.mkdir(parents=True, exist_ok=True)
    (out / "staleness.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "staleness.png")
    print(f"{len(complete)} seed(s) of every arm: {complete}\n{result['table']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
