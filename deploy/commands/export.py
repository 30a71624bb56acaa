"""`omrl export`: a run's trained policy to a directory with save_pretrained (deploy/export.py)."""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (config.toml, checkpoints/)")
    p.add_argument("out", metavar="OUT", help="a new (or empty) directory")
    p.add_argument("--step", type=int, help="the checkpoint of this learner step (default: the newest)")


def main(args: argparse.Namespace) -> int:
    from common.logs import setup_logging
    from deploy.export import export

    setup_logging("export", "INFO", sys.stderr)  # stdout is the output path
    print(export(args.run_dir, args.out, args.step))
    return 0
