"""Task files: parquet, one row per task (`env`, `task_idx`, `split`), a train and a test file
per env. Actors draw training tasks from the train split only; evaluation uses the test
split. `omrl tasks make --env NAME --out DIR` writes them from the env's index range and
held-out block (envs/specs.py); any file with those columns works, so a curated subset is
a few lines of pandas or pyarrow away.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.config import EnvConfig
from envs.specs import spec_for, spec_of

SPLITS = ("train", "test")


def write_task_files(env_name: str, out_dir: str | Path, num_tasks: int | None = None,
                     protocol: str | None = None) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, indices in zip(SPLITS, spec_for(env_name, protocol).split(num_tasks)):
        table = pa.table({"env": pa.array([env_name] * len(indices), pa.string()),
                          "task_idx": pa.array(list(indices), pa.int64()),
                          "split": pa.array([split] * len(indices), pa.string())})
        paths[split] = out / f"{split}.parquet"
        pq.write_table(table, paths[split])
    return paths


def read_tasks(path: str | Path, env_name: str | None = None) -> list[int]:
    """The task indices of a task file; with `env_name`, refuse a file of another env."""
    import pyarrow.parquet as pq

    if not Path(path).is_file():
        raise ValueError(f"task file {path} does not exist (env.tasks): write it with `omrl tasks make`")
    try:
        table = pq.read_table(path, columns=["env", "task_idx"])
    except (OSError, KeyError) as exc:
        raise ValueError(f"task file {path} is not a task file ({exc}): write it with `omrl tasks make`") from None
    envs = set(table.column("env").to_pylist())
    if env_name is not None and envs - {env_name}:
        raise ValueError(f"task file {path} holds tasks of {sorted(envs)}, not of env.name={env_name!r}")
    return table.column("task_idx").to_pylist()


def task_split(cfg: EnvConfig) -> tuple[Sequence[int], Sequence[int]]:
    """(train, test) task indices for the configured env; never overlapping."""
    if cfg.tasks is None:
        return spec_of(cfg).split(cfg.num_tasks)
    train, test = (read_tasks(Path(cfg.tasks) / f"{split}.parquet", cfg.name) for split in SPLITS)
    overlap = set(train) & set(test)
    if overlap:
        raise ValueError(f"env.tasks={cfg.tasks}: {len(overlap)} tasks are in both train and test "
                         f"(for example {sorted(overlap)[:5]}): no test task may be trained on")
    if not train or not test:
        raise ValueError(f"env.tasks={cfg.tasks}: the train and the test split must both hold tasks")
    return train, test


def task_data(cfg: EnvConfig) -> dict[int, dict[str, Any]]:
    """Each task's other columns in the task files (an `answer` to check, a `question`, ...), by task
    index: what reward functions see as `episode.task`. Empty without task files."""
    import pyarrow.parquet as pq

    if cfg.tasks is None:
        return {}
    data: dict[int, dict[str, Any]] = {}
    for split in SPLITS:
        for row in pq.read_table(Path(cfg.tasks) / f"{split}.parquet").to_pylist():
            extra = {k: v for k, v in row.items() if k not in ("env", "task_idx", "split")}
            if extra:
                data[int(row["task_idx"])] = extra
    return data
