"""Metrics: one JSON object per learner step in RUN_DIR/metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonlSink:
    """One JSON object per line, flushed after each, so a crash loses at most one line."""

    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
