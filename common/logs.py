"""Logging set-up shared by every process: the role and pid in each line."""

from __future__ import annotations

import logging
import sys


def setup_logging(role: str, level: str = "INFO") -> None:
    fmt = f"%(asctime)s {role}[%(process)d] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, datefmt="%H:%M:%S", stream=sys.stdout, force=True)
