"""`omrl tasks make`: task files (DIR/train.parquet, DIR/test.parquet) for an env."""

from __future__ import annotations

import argparse

from common.config import EnvConfig


def add_args(p: argparse.ArgumentParser) -> None:
    tasks = p.add_subparsers(dest="tasks_command", required=True)
    p = tasks.add_parser("make", help="write DIR/train.parquet and DIR/test.parquet for an env")
    p.add_argument("--env", required=True, help="env name")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--num-tasks", type=int, default=EnvConfig().num_tasks,
                   help="task indices 0..N-1, for envs whose spec does not say (default: env.num_tasks's default)")
    p.add_argument("--protocol", choices=("id", "env_idx"), help="AgentGym protocol family (env.protocol)")


def main(args: argparse.Namespace) -> int:
    from envs.tasks import write_task_files

    try:
        paths = write_task_files(args.env, args.out, args.num_tasks, args.protocol)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0
