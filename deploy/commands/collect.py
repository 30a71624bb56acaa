"""`omrl collect`: an env's oracle (or random policy) plays tasks, with a share of its turns
mistakes (the env's or a model's) if asked; the episodes as a trajectory file
(deploy/trajectories.py)."""

from __future__ import annotations

import argparse

from common.cli import add_config_args


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--env", required=True, help="env name (env.name)")
    p.add_argument("--policy", choices=("oracle", "random"), default="oracle", help="who plays (our env server's)")
    p.add_argument("--episodes", type=int, required=True, help="episodes to play: the first N tasks of the split")
    p.add_argument("--out", required=True, help="the parquet file to write")
    p.add_argument("--model", help="whose tokenizer and chat template (model.path); default: the tiny model's")
    p.add_argument("--tasks", help="task files directory (env.tasks); default: the env's own split")
    p.add_argument("--split", choices=("train", "test"), default="train", help="which split's tasks (default train)")
    p.add_argument("--only-success", action="store_true", help="keep only the episodes that solved their task")
    p.add_argument("--noise", type=float, default=0.0,
                   help="oracle: the share of turns a mistake takes instead (the env's: a random action, or the env's "
                        "typical mistake), left out of the loss, so the episodes show the oracle recovering from "
                        "mistakes (default 0)")
    p.add_argument("--mistakes", choices=("env", "model"), default="env",
                   help="--noise: whose turns the mistakes are: the env's (default), or the model's (--model, "
                        "sampled at --temperature): the oracle's turns then label the states the model reaches "
                        "(DAgger's data)")
    p.add_argument("--temperature", type=float, default=1.0, help="--mistakes model: the model's sampling temperature")
    p.add_argument("--seed", type=int, default=0, help="--noise: the seed of which turns are mistakes")


def main(args: argparse.Namespace) -> int:
    from deploy.trajectories import collect_main

    return collect_main(args)
