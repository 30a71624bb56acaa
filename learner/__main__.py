"""`python -m learner --config run.toml`: the learner process."""

from __future__ import annotations

import argparse
import os
import sys

from common.cli import Preflight, add_config_args, config_from_args, log_config, pin_cpus
from common.logs import setup_logging


def main(argv: list[str] | None = None, preflight: Preflight | None = None) -> None:
    """`preflight(cfg, debug)` runs before anything starts (`omrl ROLE` passes the checks)."""
    parser = argparse.ArgumentParser(prog="omrl learner", description="Run the learner (reads groups, trains, publishes weights).")
    add_config_args(parser)
    parser.add_argument("--steps", type=int, help="shorthand for --set learner.steps=N")
    args = parser.parse_args(argv)
    cfg = config_from_args(args, {"learner.steps": args.steps or None})
    if preflight is not None:
        preflight(cfg, args.debug)
    rank = os.environ.get("RANK", "0") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    setup_logging("learner" if rank is None else f"learner-r{rank}", cfg.run.log_level)
    log_config(cfg)
    pin_cpus(cfg.learner.cpus, "learner.cpus")
    from learner.worker import main as run

    sys.exit(run(cfg))


if __name__ == "__main__":
    main()
