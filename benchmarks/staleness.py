"""`omrl bench staleness`: does the off-policy correction keep learning intact as the data
gets staler? The same built-in env (`grid_nav`, the suite env learned furthest from its
observations) is trained through `omrl run` synchronously (eta = 0: every group generated
by the weights it is trained against) and asynchronously at eta = 2, 4 and 8, each with
the decoupled loss (`learner.loss = "decoupled"`: the PPO ratio against the learner's own
weights, the behaviour policy's tokens weighted by a capped importance weight) and with the
naive one (`"naive"`: the ratio against the behaviour log-probs, as if the data were fresh),
for several seeds each. AReaL's Table 3 is the standard: at staleness 4 the decoupled loss
keeps the synchronous score while the naive one collapses.

Per run: the mean reward of the last fifth of the steps (the table's figure, over the
seeds), the reward at every step and at its wall time (the plot), the staleness the
groups actually had, and the share of tokens the loss clipped. Rows are each async
configuration's final reward over the synchronous one's, seed by seed.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import omrl_run, pyplot, row
from common.cli import override

SETTINGS = ["env.name=grid_nav", "actor.max_tokens=1", "actor.max_turns=8", "run.log_level=WARNING"]
ETAS = (2, 4, 8)
LOSSES = ("decoupled", "naive")
SEEDS = (0, 1)
STEPS = 80
QUICK = {"etas": (2,), "losses": ("naive",), "seeds": (0,), "steps": 3}
SMOOTH = 8  # steps in the plot's moving average


def label(eta: int, loss: str) -> str:
    return "sync" if eta == 0 else f"eta={eta} {loss}"


def settings(eta: int, loss: str, seed: int) -> list[str]:
    fields = {"learner.mode": "sync"} if eta == 0 else {"learner.mode": "async", "learner.eta": eta}
    fields.update({"learner.loss": loss, "learner.seed": seed, "actor.seed": 100 * seed})
    return [*SETTINGS, *(override(k, v) for k, v in fields.items())]


def figures(run_dir: Path, window: int) -> dict:
    """A finished run's figures; its final reward is the mean over its last `window` steps."""
    from common.metrics import read_jsonl

    by_step = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}  # a retrained step: the last line
    records = [by_step[s] for s in sorted(by_step)]
    rewards = [r["reward/mean"] for r in records]
    return {"rewards": rewards, "times": [r["time"] - records[0]["time"] for r in records],
            "reward_last_fifth": statistics.mean(rewards[-window:]),
            "staleness_mean": statistics.mean(r["staleness/mean"] for r in records),
            "staleness_max": max(r["staleness/max"] for r in records),
            "frac_clipped": statistics.mean(r.get("learner/frac_clipped", 0.0) for r in records),
            "ess": statistics.mean(r.get("learner/ess", 1.0) for r in records)}


def run(quick: bool, device: str = "cpu") -> dict:
    etas, losses, seeds, steps = (QUICK["etas"], QUICK["losses"], QUICK["seeds"], QUICK["steps"]) if quick else \
        (ETAS, LOSSES, SEEDS, STEPS)
    configs = [(0, "decoupled")] + [(eta, loss) for eta in etas for loss in losses]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="omrl-bench-staleness-") as tmp:
        for seed in seeds:  # every configuration once per seed, in turn
            for eta, loss in configs:
                name = f"{label(eta, loss).replace(' ', '-')}-s{seed}"
                started = time.monotonic()
                # quick: every step's reward (a few steps of an untrained model may all score 0)
                result = figures(omrl_run(Path(tmp), name, settings(eta, loss, seed), steps),
                                 steps if quick else max(1, steps // 5))
                result.update(eta=eta, loss=loss, seed=seed, config=label(eta, loss), wall_s=time.monotonic() - started)
                runs.append(result)
                print(f"staleness {name:<22} reward (last fifth) {result['reward_last_fifth']:.3f}  staleness "
                      f"{result['staleness_mean']:.2f} (max {result['staleness_max']})  clipped "
                      f"{result['frac_clipped']:.3f}  ess {result['ess']:.2f}  ({result['wall_s']:.0f} s)", flush=True)
    sync = {r["seed"]: r["reward_last_fifth"] for r in runs if r["eta"] == 0}
    rows = []
    for eta, loss in configs[1:]:
        mine = {r["seed"]: r["reward_last_fifth"] for r in runs if (r["eta"], r["loss"]) == (eta, loss)}
        rows.append(row(f"{label(eta, loss)} vs sync: reward, last fifth of {steps} steps",
                        [mine[s] for s in seeds], [sync[s] for s in seeds]))
    result = {"runs": runs, "rows": rows, "steps": steps, "settings": SETTINGS, "seeds": list(seeds)}
    result["table"] = table(result)
    print(result["table"], flush=True)
    return result


def table(result: dict) -> str:
    """Markdown: final reward per configuration, each seed and the mean, and the staleness seen."""
    lines = ["| configuration | reward, last fifth (per seed) | mean | staleness mean / max | clipped | ess |",
             "|---|---|---|---|---|---|"]
    for config in dict.fromkeys(r["config"] for r in result["runs"]):
        mine = [r for r in result["runs"] if r["config"] == config]
        per_seed = ", ".join(f"{r['reward_last_fifth']:.3f}" for r in mine)
        lines.append(f"| {config} | {per_seed} | {statistics.mean(r['reward_last_fifth'] for r in mine):.3f} | "
                     f"{statistics.mean(r['staleness_mean'] for r in mine):.2f} / "
                     f"{max(r['staleness_max'] for r in mine)} | {statistics.mean(r['frac_clipped'] for r in mine):.3f} | "
                     f"{statistics.mean(r['ess'] for r in mine):.2f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> None:
    plt = pyplot()
    fig, (by_step, by_time, final) = plt.subplots(1, 3, figsize=(18, 4.5))
    configs = list(dict.fromkeys(r["config"] for r in result["runs"]))
    etas = sorted({r["eta"] for r in result["runs"]})
    colour = {eta: "black" if eta == 0 else f"C{i}" for i, eta in enumerate(etas)}
    for config in configs:
        mine = [r for r in result["runs"] if r["config"] == config]
        n = min(len(r["rewards"]) for r in mine)
        rewards = np.mean([r["rewards"][:n] for r in mine], axis=0)
        times = np.mean([r["times"][:n] for r in mine], axis=0)
        k = min(SMOOTH, n)
        smooth = np.convolve(rewards, np.ones(k) / k, mode="valid")
        style = dict(color=colour[mine[0]["eta"]], ls="--" if mine[0]["loss"] == "naive" and mine[0]["eta"] else "-",
                     lw=2 if mine[0]["eta"] == 0 else 1.2, label=config)
        by_step.plot(np.arange(k, n + 1), smooth, **style)
        by_time.plot(times[k - 1:], smooth, **style)
    by_step.set_title(f"reward per step ({SMOOTH}-step mean, mean over {len(result['seeds'])} seed(s))")
    by_step.set_xlabel("learner step")
    by_time.set_title("reward against wall time")
    by_time.set_xlabel("seconds since the first step")
    for i, config in enumerate(configs):
        mine = [r for r in result["runs"] if r["config"] == config]
        final.bar(i, statistics.mean(r["reward_last_fifth"] for r in mine), color=colour[mine[0]["eta"]],
                  hatch="//" if mine[0]["loss"] == "naive" and mine[0]["eta"] else None, alpha=0.8)
        final.plot([i] * len(mine), [r["reward_last_fifth"] for r in mine], "k.")
    final.set_xticks(range(len(configs)), [c.replace(" ", "\n") for c in configs], fontsize=8)
    final.set_title(f"reward, last fifth of {result['steps']} steps (dots: seeds)")
    for ax in (by_step, by_time, final):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
