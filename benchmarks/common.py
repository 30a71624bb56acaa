"""What every benchmark shares: alternating the system's path with its baseline, the median
and range of a figure and of a ratio, a table row, waiting for a server a benchmark
started, one `omrl run` to the end, and the plotting backend."""

from __future__ import annotations

import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

from common import retry
from common.cli import run_omrl


def spread(values: list[float]) -> dict:
    """{"median", "min", "max"} of the values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def alternate(measures: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Run each measure once per repetition, in turn (a, b, a, b, ...), so a slow spell of
    the machine falls on every kind alike: each kind's figures, in repetition order."""
    runs: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(repeats):
        for name, measure in measures.items():
            runs[name].append(measure())
    return runs


def ratios(system: list[float], baseline: list[float]) -> dict:
    """Median and range of system / baseline, repetition by repetition."""
    return spread([a / b for a, b in zip(system, baseline)])


def row(measure: str, system: list[float], baseline: list[float]) -> dict:
    """One line of the table: the medians and the ratio's median and range (1.0: the system
    costs nothing over its baseline, where higher figures are better)."""
    return {"measure": measure, "system": statistics.median(system), "baseline": statistics.median(baseline),
            "ratio": ratios(system, baseline)}


def pyplot():
    """matplotlib's pyplot on the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def wait_http(port: int, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    """Until http://127.0.0.1:port/ answers; fails at once if `proc` (the server) exits."""
    retry.wait_http(f"http://127.0.0.1:{port}/", timeout, proc.poll if proc is not None else None)


def omrl_run(root: Path, name: str, sets: list[str], steps: int) -> Path:
    """`omrl run` to `steps` steps in root/name with these --set overrides, its output in
    root/name.log; the run directory. A failed run raises with the log's tail."""
    run_dir = root / name
    run_omrl(["run", "--run-dir", str(run_dir), "--steps", str(steps)], root / f"{name}.log", sets, timeout=30 * 60)
    return run_dir
