"""Metrics: one JSON object per learner step in RUN_DIR/metrics.jsonl, and the same numbers in the
sinks `run.metrics` names (TensorBoard, W&B, MLflow), each imported only when named.

The JSONL file is the run's record: plots, `omrl status` and resumes read it, so it is always
written and a sink that fails is dropped with a warning while the run goes on. The names of the
metrics, their units and healthy values: docs/reference/metrics.md."""

from __future__ import annotations

import json
import logging
import math
import numbers
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from common.logs import first_line

log = logging.getLogger(__name__)

# The modules each optional sink imports (preflight checks they are there before a run starts), and
# what pip installs them (MLflow's own store in the run dir is a SQLite database: SQLAlchemy, Alembic).
SINK_PACKAGES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy", "alembic")}
SINK_PIP = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny sqlalchemy alembic"}
# In the run dir: a restarted learner logs under the same run id.
RUN_ID_FILES = {"wandb": "wandb-run-id", "mlflow": "mlflow-run-id"}


def install_hint(name: str) -> str:
    """What to do when a package of sink `name` is missing."""
    return (f"pip install {SINK_PIP[name]} (or 'openmanus-rl[metrics]'), or take {name!r} out of "
            "run.metrics")


def kept_run_id(run_dir: Path, sink: str) -> str | None:
    """The run id a sink kept in `run_dir` (a restarted learner logs under it), if any."""
    path = run_dir / RUN_ID_FILES[sink]
    return path.read_text().strip() or None if path.exists() else None


def chosen_sinks(run_cfg) -> list[str]:
    """The optional sinks run.metrics names, once each, in its order."""
    return [name for name in dict.fromkeys(run_cfg.metrics) if name in SINK_PACKAGES]


def append_jsonl(path: str | Path):
    """`path` opened to append lines: a last line a killed writer left unfinished is cut off
    first, so the next record starts a line of its own."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        with open(path, "r+b") as f:
            end = pos = f.seek(0, 2)
            keep = 0
            while pos > 0:  # back to the last newline, a block at a time
                size = min(pos, 1 << 16)
                f.seek(pos - size)
                newline = f.read(size).rfind(b"\n")
                if newline >= 0:
                    keep = pos - size + newline + 1
                    break
                pos -= size
            if keep != end:
                log.warning("%s: cut off an unfinished last line (%d bytes)", path, end - keep)
                f.truncate(keep)
    return open(path, "a", encoding="utf-8")


class JsonlSink:
    """One JSON object per line, flushed after each, so a crash loses at most one line."""

    def __init__(self, path: str | Path):
        self._file = append_jsonl(path)

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


def last_step(run_dir: str | Path) -> int:
    """The newest step a run's learner recorded in RUN_DIR/metrics.jsonl (0 before its first)."""
    path = Path(run_dir) / "metrics.jsonl"
    return max((r["step"] for r in read_jsonl(path)), default=0) if path.exists() else 0


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers, the step and the wall time left out (the sinks take those
    apart); lists (group ids, histograms) and text stay in the JSONL."""
    return {k: float(v) for k, v in record.items()
            if k not in ("step", "time") and isinstance(v, numbers.Real) and math.isfinite(v)}


class TensorBoardSink:
    """Event files in RUN_DIR/tensorboard, one scalar series per metric (`tensorboard --logdir RUN_DIR`)."""

    def __init__(self, run_dir: Path, cfg):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(_dump(cfg), indent=2, sort_keys=True) + "\n```", 0)

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
    dir, its charts against the learner's `step` (a metric of its own: a step trained again after a
    restart is logged again, not dropped as an old step). A restarted learner logs under the same
    id (RUN_DIR/wandb-run-id): offline, each start is a folder of its own that `wandb sync` puts
    into that one run."""

    def __init__(self, run_dir: Path, cfg):
        import wandb

        run_id = kept_run_id(run_dir, "wandb") or uuid.uuid4().hex[:12]
        self.run = wandb.init(project=cfg.run.wandb_project, name=run_dir.resolve().name, id=run_id, resume="allow",
                              dir=str(run_dir), mode=cfg.run.wandb_mode, config=_dump(cfg),
                              settings=wandb.Settings(console="off", silent=True))
        (run_dir / RUN_ID_FILES["wandb"]).write_text(run_id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict[str, Any]) -> None:
        self.run.log({"step": record["step"], **scalars(record)})

    def text(self, step: int, texts: dict[str, str]) -> None:
        import wandb

        self.run.log({"step": step, "samples/episodes": wandb.Table(columns=["tag", "text"],
                                                                      data=[[k, v] for k, v in texts.items()])})

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run in experiment run.mlflow_experiment at run.mlflow_uri (unset: a SQLite store in
    RUN_DIR/mlflow.db, artifacts in RUN_DIR/mlartifacts), named after the run dir, the config as its
    parameters and as config.json. A restarted learner logs to the same run (RUN_DIR/mlflow-run-id);
    each metric is a series against the learner's step, kept episodes artifacts under samples/."""

    BATCH = 1000  # MLflow's most metrics in one log_batch

    def __init__(self, run_dir: Path, cfg):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        logging.getLogger("alembic").setLevel(logging.WARNING)  # its migrations, once per new store
        local = not cfg.run.mlflow_uri
        uri = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}" if local else cfg.run.mlflow_uri
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = kept_run_id(run_dir, "mlflow")
        if self.run_id is not None:
            try:
                self.client.update_run(self.run_id, status="RUNNING")
            except MlflowException as exc:  # the store was emptied or changed (run.mlflow_uri): a new run
                log.warning("MLflow run %s of %s is not in %s (%s): logging to a new run", self.run_id,
                            RUN_ID_FILES["mlflow"], uri, first_line(exc))
                self.run_id = None
        if self.run_id is None:
            name = cfg.run.mlflow_experiment
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                name, artifact_location=(run_dir / "mlartifacts").resolve().as_uri() if local else None)
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.resolve().name).info.run_id
            config = _dump(cfg)
            # section.field: a table (env.options, actor.rewards) as one JSON value, so that no
            # key of the user's becomes a parameter name
            params = [(f"{section}.{key}", value if isinstance(value, str) else json.dumps(value, sort_keys=True))
                      for section, fields in config.items() for key, value in fields.items()]
            from mlflow.entities import Param

            for i in range(0, len(params), 100):  # MLflow's most parameters in one log_batch
                self.client.log_batch(self.run_id, params=[Param(k, v[:6000]) for k, v in params[i:i + 100]])
            self.client.log_dict(self.run_id, config, "config.json")
            (run_dir / RUN_ID_FILES["mlflow"]).write_text(self.run_id + "\n")

    def write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        stamp = int((record.get("time") or time.time()) * 1000)  # omrl sft's records have no time
        metrics = [Metric(key, value, stamp, record["step"]) for key, value in scalars(record).items()]
        for i in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + self.BATCH])

    def text(self, step: int, texts: dict[str, str]) -> None:
        for tag, text in texts.items():  # samples/best -> samples/step-000010/best.txt
            head, _, tail = tag.rpartition("/")
            self.client.log_text(self.run_id, text, f"{head or 'text'}/step-{step:06d}/{tail}.txt")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink}


class Sinks:
    """The JSONL file and every sink `run.metrics` names, written together. A sink that cannot
    start stops the start, naming run.metrics; one that raises later is closed and dropped, with a
    warning naming it, and the others go on: the JSONL is the record. `fresh`: start over in
    `directory` (the JSONL, the event files and the run ids of an earlier run there go)."""

    def __init__(self, directory: str | Path, cfg, jsonl: str = "metrics.jsonl", fresh: bool = False):
        directory = Path(directory)
        if fresh:
            (directory / jsonl).unlink(missing_ok=True)
            for id_file in RUN_ID_FILES.values():
                (directory / id_file).unlink(missing_ok=True)
            shutil.rmtree(directory / "tensorboard", ignore_errors=True)
        self.jsonl = JsonlSink(directory / jsonl)
        self.sinks: dict[str, Any] = {}
        for name in chosen_sinks(cfg.run):
            try:
                self.sinks[name] = SINKS[name](directory, cfg)
            except Exception as exc:  # noqa: BLE001 - named, with the fix, and the started ones closed
                self.close()
                hint = install_hint(name) if isinstance(exc, ImportError) else (
                    "check run.wandb_mode (online needs WANDB_API_KEY and the network)" if name == "wandb" else
                    f"take {name!r} out of run.metrics")
                raise RuntimeError(f"run.metrics names {name!r}, which could not start: {type(exc).__name__}: "
                                   f"{exc}: {hint}") from None
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
                self._close(name)

    def _close(self, name: str) -> None:
        try:
            self.sinks.pop(name).close()
        except Exception as exc:  # noqa: BLE001 - closing must not hide how the run ended
            log.warning("metrics sink %s did not close cleanly: %s: %s", name, type(exc).__name__, exc)

    def close(self) -> None:
        self.jsonl.close()
        for name in list(self.sinks):
            self._close(name)


def _dump(cfg) -> dict[str, Any]:
    return cfg.model_dump(mode="json", exclude_none=True)

