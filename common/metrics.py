"""Metrics: one JSON object per learner step in RUN_DIR/metrics.jsonl, and the same numbers in the
sinks `run.metrics` names (TensorBoard, W&B), each imported only when named.

The JSONL file is the run's record: plots, `omrl status` and resumes read it, so it is always
written and a sink that fails is dropped with a warning while the run goes on. The names of the
metrics, their units and healthy values: docs/reference/metrics.md."""

from __future__ import annotations

import json
import logging
import math
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The package each optional sink imports (preflight checks it is there before a run starts).
SINK_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
WANDB_ID_FILE = "wandb-run-id"  # in the run dir: a restarted learner goes on logging to the same W&B run


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
    """Every record; a last line still being written (no newline yet, not yet whole JSON) is left
    out, so a live run's file can be read at any time."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    if lines and not lines[-1].endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    return [json.loads(line) for line in lines]


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers, the step and the wall time left out (the sinks take those
    apart); lists (group ids, histograms) and text stay in the JSONL."""
    return {k: float(v) for k, v in record.items()
            if k not in ("step", "time") and type(v) in (int, float, bool) and math.isfinite(v)}


class TensorBoardSink:
    """Event files in RUN_DIR/tensorboard, one scalar series per metric (`tensorboard --logdir RUN_DIR`)."""

    def __init__(self, run_dir: Path, run_cfg, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```", 0)

    def write(self, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"], walltime=record.get("time"))
        self.writer.flush()

    def text(self, step: int, texts: dict[str, str]) -> None:
        for tag, text in texts.items():
            self.writer.add_text(tag, text, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in RUN_DIR/wandb, offline by default (no account, no network), named after the run
    dir; a restarted learner resumes the same W&B run (its id is kept in RUN_DIR/wandb-run-id)."""

    def __init__(self, run_dir: Path, run_cfg, config: dict[str, Any]):
        import wandb

        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=run_cfg.wandb_project, name=run_dir.resolve().name, id=run_id, resume="allow",
                              dir=str(run_dir), mode=run_cfg.wandb_mode, config=config,
                              settings=wandb.Settings(console="off", silent=True))

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=record["step"])

    def text(self, step: int, texts: dict[str, str]) -> None:
        import wandb

        self.run.log({"samples": wandb.Table(columns=["tag", "text"], data=[[k, v] for k, v in texts.items()])}, step=step)

    def close(self) -> None:
        self.run.finish()


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink}


class Sinks:
    """The JSONL file and every sink `run.metrics` names, written together. A sink that raises is
    dropped, with a warning naming it, and the others go on: the JSONL is the record."""

    def __init__(self, directory: str | Path, run_cfg, config: dict[str, Any], jsonl: str = "metrics.jsonl"):
        directory = Path(directory)
        self.jsonl = JsonlSink(directory / jsonl)
        self.sinks: dict[str, Any] = {}
        for name in dict.fromkeys(run_cfg.metrics):
            if name in SINKS:
                try:
                    self.sinks[name] = SINKS[name](directory, run_cfg, config)
                except ImportError as exc:
                    raise ImportError(f"run.metrics names {name!r}, but {exc}: pip install {SINK_PACKAGES[name]} "
                                      f"(or 'openmanus-rl[metrics]'), or take {name!r} out of run.metrics") from None
                log.info("metrics also go to %s", name)

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)
        self._each("write", record)

    def text(self, step: int, texts: dict[str, str]) -> None:
        """Text by tag at a step (the kept episodes: RUN_DIR/samples.jsonl has them whole)."""
        self._each("text", step, texts)

    def _each(self, method: str, *args) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                getattr(sink, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a sink must not stop training; the JSONL has it all
                log.warning("metrics sink %s failed (%s: %s): dropped; metrics.jsonl goes on",
                            name, type(exc).__name__, exc)
                del self.sinks[name]

    def close(self) -> None:
        self.jsonl.close()
        for name, sink in self.sinks.items():
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - closing must not hide how the run ended
                log.warning("metrics sink %s did not close cleanly: %s: %s", name, type(exc).__name__, exc)
