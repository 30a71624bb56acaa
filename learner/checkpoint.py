"""Checkpoints: model, optimizer, step, weight version and the ids of the newest groups
trained on. Sharded: every rank writes its own part of the model and optimizer state
(torch.distributed.checkpoint), in the background if asked; rank 0 then writes the
learner's state and renames the directory into place, so a checkpoint is either whole or
absent. Groups are acknowledged only after the checkpoint that holds them, so a restarted
learner neither loses pending groups nor trains twice on acknowledged ones.

The ids are a bounded window (`learner.dedup_window`): a group can come again only while
an entry of it is still in a stream (pending, or a copy that a retried XADD wrote), and
the window covers far more than the streams can hold, so memory and checkpoints stay flat
over runs of days."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import warnings
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)
# One process (no process group) is a use DCP supports and we ask for (no_dist): its warning says nothing.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclasses.dataclass
class LearnerState:
    step: int = 0
    version: int = 0
    groups_trained: int = 0
    trained_ids: list[str] = dataclasses.field(default_factory=list)
    """The newest group ids trained on, oldest first (at most the dedup window)."""
    published: list[list[int]] = dataclasses.field(default_factory=list)
    """[version, step] of the newest weight versions published, oldest first: the step whose
    weights each version holds, so that staleness is counted in optimizer steps."""

    def published_now(self, keep: int) -> None:
        """The current version was published with the current step's weights; `keep` newest kept."""
        self.published = [p for p in self.published if p[0] != self.version][-(keep - 1):] + [[self.version, self.step]]

    def steps_behind(self, version: int) -> int:
        """Optimizer steps between the weights of `version` and the learner's now: 0 for a version
        this learner never published (-1, no generated token; or one published after its last
        checkpoint, before a crash), and for one older than every version kept, at least the steps
        behind the oldest kept."""
        steps = self._steps()
        if version in steps:
            return self.step - steps[version]
        if version >= 0 and self.published and version < self.published[0][0]:  # versions only grow
            return self.step - self.published[0][1]
        return 0

    def fresh(self, version: int) -> bool:
        """Whether tokens of `version` come from the learner's weights now (-1: no generated token).
        A version this learner never published (one published after its last checkpoint, before a
        crash) is not: its weights are gone."""
        return version < 0 or self._steps().get(version) == self.step

    def _steps(self) -> dict[int, int]:
        """version -> the step whose weights it holds, for the versions kept."""
        return dict(map(tuple, self.published))


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


FORMAT = 3
"""A directory per checkpoint, `step-NNNNNNNN/`: torch.distributed.checkpoint's files (every
rank writes its own shards, `.metadata` says where each piece of each tensor is) and
`learner.json` (the LearnerState and this format number), written last. Named by parameter
path, so a checkpoint resumes on any rank count and `parallel` kind (DCP reshards on load).
Formats 1 and 2 (one `step-N.pt` file, the whole state gathered on rank 0) are refused."""
STATE_FILE = "learner.json"
MODEL, OPTIMIZER = "model", "optimizer"  # the state dict's two parts (DCP names tensors `model.<parameter path>`)
_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def begin(directory: str | Path, step: int) -> Path:
    """The empty directory step `step`'s checkpoint is written into before `finish` names it
    (what a crash in the middle of a write left there is removed)."""
    tmp = checkpoint_path(directory, step).with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")  # one checkpoint at a time


def save_shards(state_dict: dict, path: Path, group, background: bool) -> tuple[Future, Future]:
    """Every rank, together: write this rank's part of `state_dict` into `path` (one directory
    all ranks can reach). Returns (copied, written).

    background: a thread copies the state to the CPU, then writes the copy, while training
    goes on; the tensors must not change until `copied` is done (`Trainer` waits for it
    before its next optimizer step, so the copy runs beside the next step's forward and
    backward). On a GPU the copy runs on a stream of its own, after what the caller's
    stream has queued. Otherwise: written from the tensors themselves (no copy) before this
    returns. `written` is done when this rank's part is; on rank 0 (DCP's coordinator),
    when every rank's is, with the metadata: then `finish` may run."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(path, sync_files=True)  # fsync'd: a finished checkpoint survives a power cut
    no_dist = not dist.is_initialized()
    if not background:
        done: Future = Future()
        done.set_result(dcp.save(state_dict, storage_writer=writer, process_group=group, no_dist=no_dist))
        return done, done
    cuda = next((t.device for t in torch.utils._pytree.tree_leaves(state_dict)
                 if isinstance(t, torch.Tensor) and t.is_cuda), None)
    queued = None
    if cuda is not None:
        queued = torch.cuda.Event()
        queued.record()  # the caller's stream: the copy starts after the last update
    copied: Future = Future()

    def copy_then_write():
        try:
            staged = _cpu_copy(state_dict, cuda, queued)
        except BaseException as exc:
            copied.set_exception(exc)
            raise
        copied.set_result(None)
        return dcp.save(staged, storage_writer=writer, process_group=group, no_dist=no_dist)

    return copied, _WRITER.submit(copy_then_write)


def _cpu_copy(state_dict: dict, cuda: torch.device | None, queued) -> dict:
    """`state_dict` with every tensor copied to the CPU once (a DTensor keeps its mesh and
    placements around the copy of its local shard)."""
    from torch.distributed.tensor import DTensor

    def copy(x):
        if isinstance(x, DTensor):
            return DTensor.from_local(copy(x.to_local()), x.device_mesh, x.placements, run_check=False,
                                      shape=x.shape, stride=x.stride())
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        return x

    if cuda is None:
        return torch.utils._pytree.tree_map(copy, state_dict)
    stream = torch.cuda.Stream(cuda)
    stream.wait_event(queued)
    with torch.cuda.stream(stream):
        staged = torch.utils._pytree.tree_map(copy, state_dict)
    stream.synchronize()
    return staged


def finish(tmp: Path, state: LearnerState, keep: int) -> Path:
    """Rank 0, once every rank's shards are in `tmp`: write the learner's state last, rename the
    directory to its name, drop the oldest beyond `keep`. Returns the checkpoint's path."""
    with open(tmp / STATE_FILE, "w") as f:
        json.dump({"format": FORMAT, "state": dataclasses.asdict(state)}, f)
        f.flush()
        os.fsync(f.fileno())
    path = checkpoint_path(tmp.parent, state.step)
    shutil.rmtree(path, ignore_errors=True)  # a step trained again after a crash before its acknowledgements
    os.replace(tmp, path)
    _fsync_dir(tmp.parent)  # the rename itself durable
    for old in checkpoints(tmp.parent)[:-keep]:
        shutil.rmtree(old)
    return path


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoints(directory: Path) -> list[Path]:
    """The finished checkpoints in `directory`, oldest first."""
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file())


def latest_checkpoint(directory: str | Path) -> Path | None:
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = checkpoints(directory)
    old = sorted(directory.glob("step-*.pt"))
    if not found and old:
        raise SystemExit(f"error: {old[-1]} was written by an older learner (one file, format 2; this one writes "
                         f"and reads sharded directories, format {FORMAT}): start a new run dir, or export it with "
                         f"the version that wrote it")
    return found[-1] if found else None


def read_state(path: Path) -> LearnerState:
    """The learner's state of checkpoint `path` (a directory `finish` named)."""
    data = json.loads((Path(path) / STATE_FILE).read_text())
    if data.get("format") != FORMAT:
        raise SystemExit(f"error: {path} has format {data.get('format')}, this learner reads {FORMAT}: start a "
                         f"new run dir, or export it with the version that wrote it")
    state = LearnerState(**data["state"])
    log.info("read %s: step %d, version %d, %d groups trained", path, state.step, state.version, state.groups_trained)
    return state


def load_shards(state_dict: dict, path: Path, group) -> None:
    """Every rank, together: fill `state_dict`'s tensors in place (this rank's shards of them)
    from checkpoint `path`, whatever rank count wrote it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path), process_group=group,
             no_dist=not dist.is_initialized())


def read_model(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model's tensors of checkpoint `path` whose names start with `prefix`, whole, on the CPU,
    in one process: only they are read (no optimizer state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    wanted = f"{MODEL}.{prefix}"
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in reader.read_metadata().state_dict_metadata.items()
             if key.startswith(wanted) and isinstance(meta, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {key[len(MODEL) + 1:]: tensor for key, tensor in state.items()}

