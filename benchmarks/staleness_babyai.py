"""`python -m benchmarks.staleness_babyai OUT`: the staleness study's second env (issue 26).

BabyAI GoToLocal (level 5) from the demo's SFT model (`omrl demo babyai`'s stages up to the
evaluation before RL, run here through the demo's own code into OUT/demo, or skipped where
they are done), then the demo's RL stage (60 steps, GRPO, its settings) in two arms, 3 seeds:

- `sync`: `learner.mode = "sync"`;
- `async eta=4`: the default correction and trust region (`learner.loss`, `learner.minibatches`
  as the config defaults them), `learner.mode = "async"`, `learner.eta = 4`.

Seed s sets `learner.seed = s` and `actor.seed = 100 s`; seeds run in turn (both arms on seed 0,
then seed 1, ...). Each run's RL model is exported and plays GoToLocal's 1,000 held-out episodes
greedily, as the demo's evaluation after RL does.

The criterion, fixed before any run (issue 26): a run's result is that held-out greedy success;
per arm its mean with a 95% t-interval over seeds, and async's paired difference from sync
(seed by seed) with its own interval. The goal: async's mean at least 0.95 of sync's. Reported
beside it, not judged: the training success of the last fifth of steps, the RL stage's wall
time (the actors and the learner share both cores here, as in the demo), the staleness of
trained groups and the share of clipped tokens.

Every finished run's figures are kept as OUT/NAME.json; a run found there is not run again.
The report: OUT/staleness-babyai.json, .md, .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import pyplot
from benchmarks.staleness import _band, _ci, commit, figures, run_name
from common.cli import override
from common.stats import interval

LEVEL = 5  # GoToLocalS8N7
ARMS = [("sync", {"learner.mode": "sync"}), ("async eta=4", {"learner.mode": "async", "learner.eta": 4})]
SEEDS = (0, 1, 2)
GOAL = 0.95  # async's mean held-out success over sync's, at least


def prepared_demo(out: Path):
    """The demo's stages up to the evaluation before RL, in `out` (done stages skipped)."""
    from deploy import demo as demo_mod

    parser = argparse.ArgumentParser()
    demo_mod.add_args(parser)
    demo = demo_mod.make_demo(parser.parse_args(["babyai", "--out", str(out)]))
    demo.until_rl()
    return demo


def run(out: Path) -> dict:
    from deploy.demo import evaluate_strata

    demo = prepared_demo(out / "demo")
    runs = []
    for seed in SEEDS:
        for arm, fields in ARMS:
            name = run_name(arm, seed)
            kept = out / f"{name}.json"
            if kept.exists():
                runs.append(json.loads(kept.read_text()))
                continue
            started = time.monotonic()
            sets = [override(k, v) for k, v in {**fields, "learner.seed": seed, "actor.seed": 100 * seed}.items()]
            demo.rl(name, sets)
            rl_s = time.monotonic() - started
            held_out = evaluate_strata(demo.out, demo.out / f"{name}-model", "babyai",
                                       [demo.stratum_dir(str(LEVEL))])[0][0]
            result = figures(demo.out / name, max(1, demo.args.rl_steps // 5))
            result.update(arm=arm, seed=seed, rl_s=rl_s, commit=commit(), held_out=held_out["success"],
                          held_out_ci=held_out["success_ci"], episodes=held_out["episodes"])
            kept.write_text(json.dumps(result) + "\n")
            runs.append(result)
            print(f"staleness-babyai {name:<14} held-out {result['held_out']:.3f}  training (last fifth) "
                  f"{result['final_success']:.3f}  staleness {result['staleness_mean']:.2f}  clipped "
                  f"{result['frac_clipped']:.3f}  RL {rl_s:.0f} s", flush=True)
    before = json.loads((demo.out / "before.json").read_text())[str(LEVEL)]
    return report(runs, before["success"])


def report(runs: list[dict], before: float) -> dict:
    by = {arm: {r["seed"]: r for r in runs if r["arm"] == arm} for arm, _ in ARMS}
    sync, mine = by["sync"], by["async eta=4"]
    paired = sorted(set(sync) & set(mine))
    summary = {arm: {"seeds": len(rs), "held_out": interval([r["held_out"] for r in rs.values()]),
                     "training": interval([r["final_success"] for r in rs.values()]),
                     "rl_s": statistics.median(r["rl_s"] for r in rs.values()),
                     "staleness_mean": statistics.mean(r["staleness_mean"] for r in rs.values()),
                     "frac_clipped": statistics.mean(r["frac_clipped"] for r in rs.values())}
               for arm, rs in by.items() if rs}
    result = {"runs": runs, "level": LEVEL, "before": before, "summary": summary, "seeds": paired}
    if paired:
        diff = interval([mine[s]["held_out"] - sync[s]["held_out"] for s in paired])
        ratio = statistics.mean(mine[s]["held_out"] for s in paired) / statistics.mean(sync[s]["held_out"] for s in paired)
        result.update(async_less_sync=diff, async_over_sync=ratio, goal_met=ratio >= GOAL)
    lines = ["| arm | seeds | held-out success, GoToLocal [95% CI] | training success, last fifth | RL wall time "
             "(median) | staleness mean | clipped |", "|---|---|---|---|---|---|---|"]
    for arm, s in summary.items():
        lines.append(f"| {arm} | {s['seeds']} | {_ci(s['held_out'])} | {_ci(s['training'])} | {s['rl_s'] / 60:.1f} min "
                     f"| {s['staleness_mean']:.2f} | {s['frac_clipped']:.3f} |")
    if paired:
        lines += ["", f"Held-out success after SFT, before RL: {before:.3f}. Async less sync, paired over "
                      f"{len(paired)} seeds: {_ci(result['async_less_sync'])}; async's mean over sync's "
                      f"{result['async_over_sync']:.3f} (goal: at least {GOAL})."]
    result["table"] = "\n".join(lines) + "\n"
    return result


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (curve, bars) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, (arm, _) in enumerate(ARMS):
        runs = [r for r in result["runs"] if r["arm"] == arm]
        if not runs:
            continue
        color = "black" if arm == "sync" else "C0"
        x, mean, lo, hi = _band(runs, lambda r: np.arange(1, len(r["success"]) + 1, dtype=float))
        curve.plot(x, mean, color=color, label=f"{arm} ({len(runs)} seeds)")
        curve.fill_between(x, lo, hi, color=color, alpha=0.15)
        mean, lo, hi = result["summary"][arm]["held_out"]
        bars.bar(i, mean, color=color, alpha=0.6)
        if not np.isnan(lo):
            bars.errorbar(i, mean, yerr=[[mean - lo], [hi - mean]], color="k", capsize=4)
        bars.plot([i] * len(runs), [r["held_out"] for r in runs], "k.")
    bars.axhline(result["before"], color="grey", ls=":", label="after SFT, before RL")
    curve.set(title="training success (sampled, 8-step trailing mean; band: 95% CI)", xlabel="learner step")
    bars.set_xticks(range(len(ARMS)), [a for a, _ in ARMS])
    bars.set(title="held-out greedy success, GoToLocal, 1,000 episodes (95% CI; dots: seeds)",
             ylim=(min(0.5, result["before"] - 0.05), 1.0))
    for ax in (curve, bars):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    result = run(out)
    (out / "staleness-babyai.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "staleness-babyai.md").write_text(result["table"])
    plot(result, out / "staleness-babyai.png")
    print(result["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
