"""Plots of a run's metrics.jsonl: reward, throughput and staleness per learner step, and the
evaluations on held-out tasks when the run made some (learner.eval_every)."""

from __future__ import annotations

from pathlib import Path

from common.metrics import read_jsonl


def plot_metrics(metrics_path: str | Path, out_path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(metrics_path)
    steps = [r["step"] for r in rows]
    panels = [("reward/mean", "mean reward"), ("perf/tokens_per_s", "trained tokens/s"),
              ("staleness/mean", "mean staleness (optimizer steps)")]
    evals = [r for r in rows if "eval/reward" in r]
    fig, axes = plt.subplots(1, len(panels) + bool(evals), figsize=(5 * (len(panels) + bool(evals)), 3.5))
    for ax, (key, title) in zip(axes, panels):
        values = [r.get(key, float("nan")) for r in rows]
        ax.plot(steps, values, alpha=0.4, label="per step")
        ax.plot(steps, _rolling_mean(values, 10), label="mean of 10")
        _finish(ax, title)
    if evals:
        ax = axes[-1]
        x = [r["step"] for r in evals]
        for key, label in (("eval/reward", "mean reward"), ("eval/success", "success rate")):
            ci = [r[f"{key}_ci"] for r in evals]
            y = [r[key] for r in evals]
            errorbar_ci(ax, x, y, ci, "o-", label=label)
        _finish(ax, "held-out tasks, greedy (95% CI)")
    fig.tight_layout()
    out_path = Path(out_path)
    partial = out_path.with_name(f".{out_path.name}.partial")  # a reader never sees half a file
    fig.savefig(partial, dpi=100, format=out_path.suffix.lstrip(".") or "png")
    plt.close(fig)
    partial.replace(out_path)
    return out_path


def errorbar_ci(ax, x, y, ci, fmt, **kw) -> None:
    """Points `y` with their intervals `ci` ((low, high) each) as error bars."""
    ax.errorbar(x, y, yerr=[[v - c[0] for v, c in zip(y, ci)], [c[1] - v for v, c in zip(y, ci)]], fmt=fmt,
                capsize=3, **kw)


def _finish(ax, title: str) -> None:
    ax.legend(loc="best", fontsize=8)
    ax.set_title(title)
    ax.set_xlabel("learner step")
    ax.grid(alpha=0.3)


def _rolling_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
