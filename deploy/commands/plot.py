"""`omrl plot RUN_DIR`: RUN_DIR/metrics.png from the run's metrics.jsonl, at any time (a live run's
too: `omrl run` also redraws it every run.plot_every_s)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run's directory (run.run_dir)")
    p.add_argument("--out", help="where to write the plot (default RUN_DIR/metrics.png)")


def main(args: argparse.Namespace) -> int:
    metrics = Path(args.run_dir) / "metrics.jsonl"
    if not metrics.is_file():
        print(f"error: {metrics} does not exist: is {args.run_dir} a run directory (run.run_dir), and has its "
              "learner finished a step?", file=sys.stderr)
        return 2
    from deploy.plots import plot_metrics

    try:
        print(plot_metrics(metrics, args.out or Path(args.run_dir) / "metrics.png"))
    except ImportError:
        print("error: matplotlib is not installed: pip install 'openmanus-rl[plot]'", file=sys.stderr)
        return 2
    return 0
