"""`omrl run`: the embedded default (deploy/supervisor.py)."""

from __future__ import annotations

import argparse

from common.cli import add_config_args


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--steps", type=int, help="learner steps (learner.steps)")
    p.add_argument("--run-dir", help="where metrics.jsonl, logs and the model go (run.run_dir)")
    p.add_argument("--model", help="a Hugging Face causal LM, path or hub id (model.path); default: the tiny model")


def main(args: argparse.Namespace) -> int:
    from deploy.supervisor import run

    return run(args)
