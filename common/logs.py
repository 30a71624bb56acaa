"""Logging set-up shared by every process: the role and pid in each line."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(role: str, level: str = "INFO", stream=None) -> None:
    """Log lines to `stream` (stdout by default; commands whose output is data log to stderr, and
    so does the vLLM engine they start, whose own logging is set up when it is first imported)."""
    if stream is sys.stderr:
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    fmt = f"%(asctime)s {role}[%(process)d] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, datefmt="%H:%M:%S", stream=stream or sys.stdout, force=True)


def first_line(exc: BaseException) -> str:
    """An exception in one line (a C++ collective's message runs over several)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
