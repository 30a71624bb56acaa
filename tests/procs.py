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


def descendants(pid: int) -> list[str]:
    """The first word of the command line (a process's title, where it set one: vLLM's
    "VLLM::EngineCore") of every process below `pid`, children first."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    parents.setdefault(int(f.read().rsplit(") ", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], list(parents.get(pid, []))
    while todo:
        child = todo.pop(0)
        with contextlib.suppress(OSError):
            with open(f"/proc/{child}/cmdline", "rb") as f:
                found.append(f.read().split(b"\0")[0].decode(errors="replace"))
        todo += parents.get(child, [])
    return found
