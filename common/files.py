"""Files and directories that readers see whole or not at all: written under a temporary name
beside the target, then renamed onto it (rename(2) is atomic within a filesystem). A process
that dies while writing leaves the earlier file (or none) beside a temporary one; a write that
fails removes its temporary file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes, sync: bool = True) -> None:
    """`data` (text is UTF-8) in `path`, whole or not at all; `sync`: on disk before the rename,
    so that a machine that loses power keeps the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def temporary_beside(path: str | Path) -> Path:
    """An empty, absent name in `path`'s folder for a directory that `replace_dir` then moves
    onto `path` (one left by a dead process of the same id is removed)."""
    path = Path(path).absolute()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def replace_dir(new: str | Path, path: str | Path) -> None:
    """Rename the directory `new` to `path`. A `path` that holds files is first renamed aside
    and removed after, so `path` is at every moment the old directory, absent, or the new one."""
    new, path = Path(new), Path(path)
    try:
        os.replace(new, path)  # rename(2) replaces a missing or empty directory
        return
    except OSError:
        if not path.is_dir():
            raise
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)
