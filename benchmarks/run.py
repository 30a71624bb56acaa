"""`omrl bench NAME [--quick] [--out DIR]`: run benchmarks, each a ratio of the system's
path against a baseline measured in the same run; OUT/NAME.json and OUT/NAME.png per
benchmark, and OUT/table.md of every result in OUT.

A benchmark is a module in BENCHMARKS with `run(quick, device) -> {"rows": [...], ...}` (each
row: measure, system, baseline, ratio {median, min, max}; benchmarks/common.py builds them)
and `plot(result, path)`. `--quick` runs each in seconds, as a smoke test of the figures'
shape, never of a speed. `--device cuda` runs the model-bearing benchmarks on a GPU."""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from pathlib import Path

from common.progress import Progress

BENCHMARKS = {"broker": "benchmarks.broker", "pipeline": "benchmarks.pipeline", "weights": "benchmarks.weights",
              "engine": "benchmarks.engine", "learner": "benchmarks.learner", "memory": "benchmarks.memory",
              "shards": "benchmarks.shards", "fanout": "benchmarks.fanout", "env": "benchmarks.env",
              "staleness": "benchmarks.staleness", "scale": "benchmarks.scale", "evaluator": "benchmarks.evaluator",
              "fuzz": "benchmarks.fuzz"}
# Run by name only, never by `all`: they take their minutes whatever --quick says of the others.
BY_NAME_ONLY = {"soak": "benchmarks.soak", "onednn": "benchmarks.onednn"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=[*BENCHMARKS, *BY_NAME_ONLY, "all"],
                   help="the benchmark, or all of them (but soak and onednn: by name only)")
    p.add_argument("--quick", action="store_true", help="seconds per benchmark: a smoke test, not a measurement")
    p.add_argument("--out", default="bench-results", help="directory for NAME.json, NAME.png and table.md")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where models run (learner, engine, weights); cuda needs a GPU and OMRL_EXTRA=gpu's vLLM")
    p.add_argument("--minutes", type=float, help="soak: how long the run goes on (default 120; --quick: 10); onednn: "
                   "how long the engines generate (default 8; --quick: 1)")


def main(args: argparse.Namespace) -> int:
    if args.minutes is not None and args.name not in BY_NAME_ONLY:
        print(f"error: --minutes is for {' and '.join(BY_NAME_ONLY)}: omrl bench {args.name} takes no duration",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda: torch sees no GPU here (torch.cuda.is_available() is False); "
                  "run on a GPU machine set up with OMRL_EXTRA=gpu, or leave --device out", file=sys.stderr)
            return 2
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    results = {}
    bar = Progress(len(names) if len(names) > 1 else 0, "benchmarks", "bench")
    for name in names:
        module = importlib.import_module({**BENCHMARKS, **BY_NAME_ONLY}[name])
        started = time.monotonic()
        result = module.run(args.quick, args.device, **({"minutes": args.minutes, "out": out} if name in BY_NAME_ONLY else {}))
        result.update(name=name, quick=args.quick, device=args.device, seconds=time.monotonic() - started, machine=machine())
        (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        module.plot(result, out / f"{name}.png")
        results[name] = result
        print(f"{name}: {out / f'{name}.json'}, {out / f'{name}.png'} ({result['seconds']:.0f} s)")
        bar.update(note=name)
    bar.close()
    print(markdown_table(results))
    # The table covers every benchmark whose result is in OUT, so one benchmark run again
    # (say `omrl bench pipeline --out DIR` after `all`) updates its rows in place.
    kept = {name: json.loads((out / f"{name}.json").read_text()) for name in {**BENCHMARKS, **BY_NAME_ONLY}
            if (out / f"{name}.json").exists()}
    (out / "table.md").write_text(markdown_table(kept))
    return 0


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def markdown_table(results: dict[str, dict]) -> str:
    lines = ["| benchmark | measure | system | baseline | system / baseline (median, range) |", "|---|---|---|---|---|"]
    for name, result in results.items():
        shown = f"{name} (quick)" if result.get("quick") else name
        for row in result["rows"]:
            r = row["ratio"]
            lines.append(f"| {shown} | {row['measure']} | {_figure(row['system'])} | {_figure(row['baseline'])} | "
                         f"x{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) |")
    return "\n".join(lines) + "\n"


def _figure(x: float) -> str:
    """Whole numbers from 100 up (with thousands separators), three significant digits below."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"
