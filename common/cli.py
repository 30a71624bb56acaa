"""Argument handling shared by the `omrl` commands and the role entry points (`python -m
actors|learner|envs`), and `omrl` run as a child process."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import Config, ConfigError, dump_toml, load_config, toml_value
from common.liveness import die_with_parent

Preflight = Callable[[Config, bool], None]  # checks before a role starts: (config, show tracebacks)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file with every section (see README)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one field, for example --set learner.lr=1e-3 (repeatable)")
    parser.add_argument("--debug", action="store_true",
                        help="tracebacks with the one-line errors of the checks before start")


def override(dotted: str, value: Any) -> str:
    """The --set text that gives field `dotted` (section.field) this Python value."""
    return f"{dotted}={toml_value(value)}"


def config_from_args(args: argparse.Namespace, flags: dict[str, Any] | None = None) -> Config:
    """The config of --config and --set, then of a command's own flags: `flags` maps a field's
    dotted name to its flag's value (None: the flag was not given)."""
    extra = [override(dotted, value) for dotted, value in (flags or {}).items() if value is not None]
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


class CommandFailed(RuntimeError):
    """An `omrl` child command exited with an error; the message ends with its log's last lines."""

    def __init__(self, argv: list[str], code: int, log_path: Path, tail: list[str]):
        super().__init__(f"`omrl {' '.join(argv[:1])}` exited with {code}; its log: {log_path}\n" + "\n".join(tail))
        self.code, self.log_path, self.tail = code, log_path, tail


def run_omrl(argv: list[str], log_path: Path, overrides: list[str] = (), timeout: float | None = None,
             tail_lines: int = 40) -> None:
    """`omrl ARGV --set OVERRIDE...` as a child process of this Python, its stdout and stderr
    in `log_path`. Ctrl-C (or SIGTERM, see stop_on_sigterm) and the timeout stop the child as
    it stops itself (its engines, its processes) before going on; CommandFailed when it fails."""
    argv = [*argv, *[arg for kv in overrides for arg in ("--set", kv)]]
    with open(log_path, "w") as out:
        child = subprocess.Popen([sys.executable, "-m", "deploy.cli", *argv], stdout=out, stderr=subprocess.STDOUT,
                                 preexec_fn=die_with_parent)
        try:
            code = child.wait(timeout)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            child.terminate()
            child.wait(120)
            raise
    if code != 0:
        raise CommandFailed(argv, code, log_path, Path(log_path).read_text(errors="replace").splitlines()[-tail_lines:])
