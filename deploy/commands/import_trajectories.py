"""`omrl import-trajectories`: AgentGym / OpenManus-RL conversation files to a trajectory file
(deploy/trajectories.py)."""

from __future__ import annotations

import argparse

from common.cli import add_config_args


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("source", metavar="FILE", help="a JSON list or JSON lines of records with `conversations`")
    p.add_argument("--out", required=True, help="the parquet file to write")
    p.add_argument("--model", help="whose tokenizer and chat template (model.path); default: the tiny model's")


def main(args: argparse.Namespace) -> int:
    from deploy.trajectories import import_main

    return import_main(args)
