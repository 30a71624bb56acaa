"""The `omrl` command: a table of subcommands, each a module with `add_args(parser)` and
`main(args)` (its exit code). Modules import what they run inside `main`, so building every
parser is cheap and --help is instant."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NamedTuple

from common.progress import QUIET_ENV


class Command(NamedTuple):
    module: str
    help: str
    role: bool = False  # a role hands its arguments to the role's own parser: main(argv, preflight)


COMMANDS: dict[str, Command] = {
    "run": Command("deploy.commands.run",
                   "the embedded default: Redis, env server, actors and learner on this machine"),
    "status": Command("deploy.commands.status", "a run's streams, pending entries, dead letters, actors and learner"),
    "plot": Command("deploy.commands.plot", "draw RUN_DIR/metrics.png from the run's metrics.jsonl, live or finished"),
    "view": Command("deploy.commands.view", "browse the episodes a run kept, turn by turn, in a local web page"),
    "eval": Command("deploy.evaluate",
                    "play the held-out tasks of envs: success rate and mean reward with 95%% CIs"),
    # The one import of benchmarks/ (by name): nothing else outside it imports it.
    "bench": Command("benchmarks.run", "throughput benchmarks, each against a baseline in the same run"),
    "tasks": Command("deploy.commands.tasks", "task files"),
    "export": Command("deploy.commands.export",
                      "write a run's trained policy to OUT with save_pretrained (transformers, vLLM)"),
    "init-model": Command("deploy.commands.init_model",
                          "build a tiny Qwen2 model with random weights and its tokenizer in DIR"),
    "collect": Command("deploy.commands.collect",
                       "play an env's oracle (or random policy) and write the episodes as a trajectory file (parquet)"),
    "import-trajectories": Command("deploy.commands.import_trajectories",
                                   "AgentGym / OpenManus-RL conversation files (JSON, JSON lines) to a trajectory file"),
    "sft": Command("deploy.sft", "supervised fine-tuning on trajectory files, with a held-out success curve"),
    "demo": Command("deploy.demo", "a recipe end to end: oracle data, SFT, async RL, evaluation before and after"),
    "env-server": Command("envs.__main__", "serve a built-in env over HTTP (AgentGym 'id' protocol)", role=True),
    "actor": Command("actors.__main__", "run one rollout actor", role=True),
    "learner": Command("learner.__main__", "run the learner", role=True),
    "watch": Command("deploy.commands.watch",
                     "run a role (actor, learner, env-server) and exit 1 when it stops making progress (containers)"),
    "doctor": Command("deploy.commands.doctor",
                      "check everything a run needs (model, Redis, env server, ports, run dir, GPU)"),
    "plan": Command("deploy.commands.plan",
                    "will it fit: the learner's and vLLM's memory per GPU from the config and config.json"),
}
ROLE_WAIT_S = 30.0  # a role started beside its servers (compose, Kubernetes) gives them this to come up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omrl", description="OpenManus-RL: asynchronous actor-learner RL for LLM agents.")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars or lines from eval, collect, sft, demo and bench (OMRL_QUIET=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        if command.role:  # dispatched before parsing (main): listed for --help
            sub.add_parser(name, help=command.help, add_help=False)
            continue
        module = importlib.import_module(command.module)
        p = sub.add_parser(name, help=command.help)
        module.add_args(p)
        p.set_defaults(main=module.main)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS and COMMANDS[argv[0]].role:
        role = argv[0]
        module = importlib.import_module(COMMANDS[role].module)
        module.main(argv[1:], preflight=lambda cfg, debug: _preflight(cfg, role, debug))
        return
    args = build_parser().parse_args(argv)
    if args.quiet:
        os.environ[QUIET_ENV] = "1"  # the commands' child processes inherit it
    sys.exit(args.main(args))


def _preflight(cfg, role: str, debug: bool) -> None:
    from deploy.preflight import require

    require(cfg, role, debug, wait_s=ROLE_WAIT_S)


if __name__ == "__main__":
    main()
