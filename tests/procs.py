"""Processes as tests see them from outside: whether a pid still runs."""

from __future__ import annotations

import contextlib
import os


def alive(pid: int) -> bool:
    """Whether `pid` still runs. A zombie counts as gone, and one that is this process's own
    child is reaped on the way."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return not f.read().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return False
    finally:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
