"""Argument handling shared by the role entry points (`python -m actors|learner|envs`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Callable

from common.config import Config, ConfigError, dump_toml, load_config

Preflight = Callable[[Config, bool], None]  # checks before a role starts: (config, show tracebacks)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file with every section (see README)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one field, for example --set learner.lr=1e-3 (repeatable)")
    parser.add_argument("--debug", action="store_true",
                        help="tracebacks with the one-line errors of the checks before start")


def config_from_args(args: argparse.Namespace, extra: list[str] = ()) -> Config:
    try:
        return load_config(args.config, [*args.overrides, *extra])
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


def log_config(config: Config) -> None:
    logging.getLogger("config").info("resolved config:\n%s", dump_toml(config))


def pin_cpus(cpus: list[int], field: str) -> None:
    """Run this process, and every process it starts from now on, on `cpus` (empty: leave it
    be). Bad cores fail at start, naming the field."""
    if not cpus:
        return
    available = sorted(os.sched_getaffinity(0))
    if not set(cpus) <= set(available):
        print(f"error: {field} = {cpus}: this process may run on CPUs {available}; "
              f"choose among them, or leave {field} empty", file=sys.stderr)
        raise SystemExit(2)
    os.sched_setaffinity(0, cpus)
    logging.getLogger("config").info("pinned to CPUs %s (%s)", cpus, field)


def stop_on_sigterm() -> None:
    """SIGTERM ends a foreground command as Ctrl-C does: KeyboardInterrupt, so its `finally`
    blocks run and what it started (a vLLM engine's processes, child commands) stops with it."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupt)
