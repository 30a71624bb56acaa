"""Liveness: a process of a run says "I am making progress" by touching its beat file, the
path in OMRL_BEAT_FILE (`omrl run` sets one per process, in RUN_DIR/liveness). A process
that is alive but stuck (SIGSTOPped, deadlocked, an engine that stopped answering) stops
touching it; the supervisor kills and restarts a process whose file is older than
`supervisor.hang_s` (docs/concepts/faults.md), and a container's health check can read the
same file (`python -m common.liveness PATH MAX_AGE_S`, exit 1 when stale).

What counts as progress is each role's own: the env server's event loop turning; an actor's
loop turning while its engine finishes generate calls (`WeightGate.stalled_s`); the
learner's loop between steps and while it waits for groups; the embedded Redis's, answering
the supervisor's PING (deploy/supervisor.py beats for it). A process beats only once it
is up: the time before its first beat (vLLM's start, loading a model) is bounded by
`supervisor.start_grace_s` instead.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

ENV = "OMRL_BEAT_FILE"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# libc's prctl, found before any fork (the symbols this Python is linked with: no ldconfig run)
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None) if sys.platform == "linux" else None


def die_with_parent() -> None:
    """For `subprocess.Popen(preexec_fn=...)`: the child gets SIGTERM when the process that
    started it dies, however it dies (SIGKILL, the OOM killer, a test's timeout), and stops as
    it would on SIGTERM, its own children with it. Without it a child started in a session of
    its own (`omrl run`'s processes) outlives a killed parent and goes on using the CPU.
    Linux only (prctl); elsewhere nothing. The parent must start the child from a thread that
    lives as long as the child: the signal follows the thread that forked, not the process."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def beat(path: str | Path | None = None) -> None:
    """Touch this process's beat file, or `path` (nothing where neither is set)."""
    path = path or os.environ.get(ENV)
    if not path:
        return
    try:
        os.utime(path)
    except FileNotFoundError:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).touch()


async def beating(every_s: float = 1.0, progressing: Callable[[], bool] = lambda: True,
                  touch: Callable[[], None] = beat) -> None:
    """A task of the process's event loop: beat (`touch`: the beat file) every `every_s` while
    `progressing()` says so. A blocked or stopped loop stops beating with it."""
    while True:
        if progressing():
            touch()
        await asyncio.sleep(every_s)


def last_beat(path: Path) -> float | None:
    """The wall-clock time of the file's last beat, or None where it has none."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def main(argv: list[str]) -> int:
    """`python -m common.liveness PATH MAX_AGE_S`: 0 while PATH was touched within MAX_AGE_S."""
    if len(argv) != 2:
        print("usage: python -m common.liveness BEAT_FILE MAX_AGE_S", file=sys.stderr)
        return 2
    at = last_beat(Path(argv[0]))
    if at is None:
        print(f"{argv[0]}: no beat yet", file=sys.stderr)
        return 1
    age = time.time() - at
    if age > float(argv[1]):
        print(f"{argv[0]}: no progress for {age:.0f}s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
