"""The metric names docs/reference/metrics.md documents: the first cell of its tables' rows, where
one cell may name several (`a`, `b`) and `*` stands for any run of characters."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "reference" / "metrics.md"


def documented_names() -> list[str]:
    names = []
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def undocumented(keys) -> list[str]:
    """The keys no documented name (or pattern) covers."""
    names = documented_names()
    return sorted(k for k in set(keys) if not any(fnmatch.fnmatchcase(k, n) for n in names))
