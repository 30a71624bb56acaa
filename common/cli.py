"""Argument handling shared by the role entry points (`python -m actors|learner|envs`)."""

from __future__ import annotations

import argparse
import logging
import os

from common.config import Config, ConfigError, dump_toml, load_config


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file with every section (see README)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one field, for example --set learner.lr=1e-3 (repeatable)")


def config_from_args(args: argparse.Namespace, extra: list[str] = ()) -> Config:
    try:
        return load_config(args.config, [*args.overrides, *extra])
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None


def log_config(config: Config) -> None:
    logging.getLogger("config").info("resolved config:\n%s", dump_toml(config))


def pin_cpus(cpus: list[int], field: str) -> None:
    """Run this process, and every process it starts from now on, on `cpus` (empty: leave it
    be). Bad cores fail at start, naming the field."""
    if not cpus:
        return
    available = sorted(os.sched_getaffinity(0))
    if not set(cpus) <= set(available):
        raise SystemExit(f"error: {field} = {cpus}: this process may run on CPUs {available}; "
                         f"choose among them, or leave {field} empty")
    os.sched_setaffinity(0, cpus)
    logging.getLogger("config").info("pinned to CPUs %s (%s)", cpus, field)
