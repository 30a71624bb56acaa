"""`python -m actors --config run.toml [--index I]`: one actor process. With no index (a
replica of a scaled service) Redis hands out the lowest free one (broker/membership.py).
`--evaluator`: the evaluator role instead (actors/evaluator.py)."""

from __future__ import annotations

import argparse

from common.cli import Preflight, add_config_args, config_from_args, log_config, pin_cpus
from common.logs import setup_logging


def main(argv: list[str] | None = None, preflight: Preflight | None = None) -> None:
    """`preflight(cfg, debug)` runs before anything starts (`omrl ROLE` passes the checks)."""
    parser = argparse.ArgumentParser(prog="omrl actor", description="Run one rollout actor (vLLM + env clients).")
    add_config_args(parser)
    parser.add_argument("--index", type=int, default=None,
                        help="actor index: seeds and the actor id (default: the lowest free slot in Redis, "
                             "named after the host: one actor per host or container)")
    parser.add_argument("--evaluator", action="store_true",
                        help="evaluate published versions on held-out tasks (every learner.eval_every) instead of "
                             "generating rollouts: actors/evaluator.py")
    args = parser.parse_args(argv)
    if args.index is not None and args.index < 0:
        parser.error(f"--index must be 0 or more, not {args.index}")
    if args.evaluator and args.index is not None:
        parser.error("--evaluator takes no --index: an evaluator is not one of the actors")
    cfg = config_from_args(args)
    if preflight is not None:
        preflight(cfg, args.debug)
    setup_logging("evaluator" if args.evaluator else "actor" if args.index is None else f"actor{args.index}",
                  cfg.run.log_level)
    log_config(cfg)
    pin_cpus(cfg.actor.cpus, "actor.cpus")  # before vLLM starts its engine processes
    if args.evaluator:
        from actors.evaluator import main as evaluate

        evaluate(cfg)
        return
    from actors.worker import main as run

    run(cfg, args.index)


if __name__ == "__main__":
    main()
