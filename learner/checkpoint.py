"""Checkpoints: model, optimizer, step, weight version and the ids of the newest groups
trained on, written atomically (temporary file, fsync, rename). Groups are acknowledged
only after the checkpoint that holds them, so a restarted learner neither loses pending
groups nor trains twice on acknowledged ones.

The ids are a bounded window (`learner.dedup_window`): a group can come again only while
an entry of it is still in a stream (pending, or a copy that a retried XADD wrote), and
the window covers far more than the streams can hold, so memory and checkpoints stay flat
over runs of days."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_NAME = re.compile(r"^step-(\d+)\.pt$")


@dataclasses.dataclass
class LearnerState:
    step: int = 0
    version: int = 0
    groups_trained: int = 0
    trained_ids: list[str] = dataclasses.field(default_factory=list)
    """The newest group ids trained on, oldest first (at most the dedup window)."""


class RecentIds:
    """The newest `maxlen` ids, with O(1) membership."""

    def __init__(self, maxlen: int, ids: Iterable[str] = ()):
        self._order: deque[str] = deque(maxlen=maxlen)
        self._set: set[str] = set()
        self.add(ids)

    def add(self, ids: Iterable[str]) -> None:
        for gid in ids:
            if gid in self._set:
                continue
            if len(self._order) == self._order.maxlen:
                self._set.discard(self._order[0])
            self._order.append(gid)
            self._set.add(gid)

    def __contains__(self, gid: str) -> bool:
        return gid in self._set

    def __len__(self) -> int:
        return len(self._order)

    def to_list(self) -> list[str]:
        return list(self._order)


FORMAT = 2
"""Unsharded state named by parameter path (torch.distributed.checkpoint's full state dict), so a
checkpoint resumes on any rank count and `parallel` kind. Format 1 (before ranks) is refused."""


def save_checkpoint(directory: str | Path, state: LearnerState, model_state: dict, optim_state: dict,
                    keep: int) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{state.step:08d}.pt"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, "state": dataclasses.asdict(state), "model": model_state,
                    "optimizer": optim_state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in _checkpoints(directory)[:-keep]:
        old.unlink()
    return path


def _checkpoints(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("step-*.pt") if _NAME.match(p.name))


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = _checkpoints(Path(directory)) if Path(directory).is_dir() else []
    return found[-1] if found else None


def read_checkpoint(path: Path) -> tuple[LearnerState, dict, dict]:
    """(state, model state, optimizer state) of a checkpoint file."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    if data.get("format") != FORMAT:
        raise SystemExit(f"error: {path} was written by an older learner (format {data.get('format', 1)}, this one "
                         f"reads {FORMAT}): start a new run dir, or export it with the version that wrote it")
    state = LearnerState(**{"groups_trained": len(data["state"]["trained_ids"]), **data["state"]})
    log.info("read %s: step %d, version %d, %d groups trained", path, state.step, state.version, state.groups_trained)
    return state, data["model"], data["optimizer"]
