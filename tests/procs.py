"""Processes as tests see them from outside: whether a pid still runs, its command line, the
processes that mention a text and those below a pid."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


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


def cmdline(pid: int) -> str:
    """The process's command line, words joined by spaces ("" where it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def processes_mentioning(text: str) -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir()
            if e.name.isdigit() and int(e.name) != os.getpid() and text in cmdline(int(e.name))]


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
        found.append(cmdline(child).split(" ", 1)[0])
        todo += parents.get(child, [])
    return found
