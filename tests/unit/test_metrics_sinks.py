"""The metrics sinks (common/metrics.py): what the learner writes reaches metrics.jsonl, the
TensorBoard event files, an offline W&B run and an MLflow run, each read back with its own reader; a sink
that fails is dropped while the JSONL goes on; a sink whose package is missing fails before
the run starts, naming run.metrics; `omrl plot` draws a run's plot at any time."""

from __future__ import annotations

import json
import logging
import math
import struct
import subprocess
import sys
import time

import pytest

from common.config import Config, ConfigError, load_config
from common.metrics import Sinks, read_jsonl


def records(n: int = 4) -> list[dict]:
    return [{"step": s, "time": 1.7e9 + s, "reward/mean": 0.25 * s, "learner/grad_norm": 1.0 / s,
             "learner/skipped": s == 2, "perf/peak_cuda_gb": math.nan, "batch/group_ids": [f"g{s}"]}
            for s in range(1, n + 1)]


def config(*sinks: str) -> Config:
    return Config.model_validate({"run": {"metrics": list(sinks)}})


def tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_text(log_dir, tag: str) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(f"{tag}/text_summary")]


def wandb_history(run_dir, folder=None) -> list[dict]:
    """The history rows of the offline W&B run in RUN_DIR/wandb (or its `folder`), read from its
    .wandb file: a 7-byte header, then LevelDB-style blocks of 32 KiB holding records (crc, length,
    type; a record cut across blocks comes as first, middle and last pieces), each a protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (folder or next((run_dir / "wandb").glob("offline-run-*"))).glob("run-*.wandb")
    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    pieces, rows = b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the padding at a block's end
            pos += left
            continue
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_every_sink_gets_the_records_numbers_and_the_jsonl_everything(tmp_path):
    pytest.importorskip("wandb", reason="the metrics extra (pip install 'openmanus-rl[metrics]')")
    sinks = Sinks(tmp_path, config("jsonl", "tensorboard", "wandb"))
    assert set(sinks.sinks) == {"tensorboard", "wandb"}
    for record in records():
        sinks.write(record)
        if record["step"] == 2:
            sinks.text(2, {"samples/best": "**best** · reward 1.000", "samples/worst": "*model*: turn left"})
    sinks.close()
    import wandb

    wandb.teardown()  # run.finish() can return before W&B's service has written the file; exit waits for it

    assert read_jsonl(tmp_path / "metrics.jsonl")[1]["batch/group_ids"] == ["g2"]  # lists stay in the JSONL
    assert tensorboard_text(tmp_path / "tensorboard", "samples/worst") == [(2, "*model*: turn left")]
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"reward/mean", "learner/grad_norm", "learner/skipped"}  # no NaN, no lists
    assert scalars["reward/mean"] == [(s, 0.25 * s) for s in range(1, 5)]
    assert [v for _s, v in scalars["learner/skipped"]] == [0.0, 1.0, 0.0, 0.0]

    history = wandb_history(tmp_path)
    (table,) = [row for row in history if row.get("samples/episodes/_type") == "table-file"]
    (files,) = (tmp_path / "wandb").glob("offline-run-*/files")
    assert table["step"] == 2 and json.loads((files / table["samples/episodes/path"]).read_text())["data"] == [
        ["samples/best", "**best** · reward 1.000"], ["samples/worst", "*model*: turn left"]]
    scalar_rows = [row for row in history if "reward/mean" in row]
    assert [row["step"] for row in scalar_rows] == [1, 2, 3, 4]  # the learner's step, W&B's x axis
    assert [row["reward/mean"] for row in scalar_rows] == [0.25, 0.5, 0.75, 1.0]
    assert all("perf/peak_cuda_gb" not in row and "batch/group_ids" not in row for row in history)
    run_id = (tmp_path / "wandb-run-id").read_text().strip()
    # A restarted learner logs under the same id, steps it trains again included.
    again = Sinks(tmp_path, config("wandb"))
    again.write({"step": 4, "reward/mean": 2.0})
    again.close()
    wandb.teardown()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))  # offline-run-TIME-ID (-1 within a second)
    assert len(runs) == 2 and all(f"-{run_id}" in p.name for p in runs), runs
    assert any(row.get("step") == 4 and row.get("reward/mean") == 2.0 for row in wandb_history(tmp_path, runs[-1]))


def test_mlflow_gets_the_numbers_the_config_and_the_samples_and_a_restart_logs_to_the_same_run(tmp_path):
    pytest.importorskip("mlflow", reason="the metrics extra (pip install 'openmanus-rl[metrics]')")
    from mlflow.tracking import MlflowClient

    sinks = Sinks(tmp_path, config("mlflow"))
    for record in records():
        sinks.write(record)
    sinks.text(2, {"samples/best": "**best** · reward 1.000"})
    sinks.close()

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = (tmp_path / "mlflow-run-id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
    assert run.data.params["learner.lr"] == json.dumps(Config().learner.lr)  # the config, flattened
    assert set(run.data.metrics) == {"reward/mean", "learner/grad_norm", "learner/skipped"}  # no NaN, no lists
    history = client.get_metric_history(run_id, "reward/mean")
    assert sorted((m.step, m.value, m.timestamp) for m in history) == [
        (s, 0.25 * s, int((1.7e9 + s) * 1000)) for s in range(1, 5)]
    artifacts = tmp_path / "mlartifacts" / run_id / "artifacts"  # the local store keeps its files in the run dir
    assert (artifacts / "samples" / "step-000002" / "best.txt").read_text() == "**best** · reward 1.000"
    assert json.loads((artifacts / "config.json").read_text())["learner"]["lr"] == Config().learner.lr

    again = Sinks(tmp_path, config("mlflow"))  # a restarted learner, its step 4 trained again
    again.write({"step": 4, "time": 1.8e9, "reward/mean": 2.0})
    again.close()
    assert (tmp_path / "mlflow-run-id").read_text().strip() == run_id
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean"))[-2:] == [
        (4, 1.0), (4, 2.0)]
    Sinks(tmp_path, config("mlflow"), fresh=True).close()  # starting over: a new run in the same store
    assert (tmp_path / "mlflow-run-id").read_text().strip() != run_id

    # A kept id the store does not know (the store emptied, run.mlflow_uri changed): a new run, not a
    # failed start; a record with no time (omrl sft's) stamped now; a table of the config as one value.
    (tmp_path / "mlflow-run-id").write_text("0123456789abcdef\n")
    cfg = Config.model_validate({"run": {"metrics": ["mlflow"]}, "env": {"options": {"odd key!": 1}}})
    started = time.time()
    again = Sinks(tmp_path, cfg)
    again.write({"step": 1, "sft/loss": 0.5})
    again.close()
    new_id = (tmp_path / "mlflow-run-id").read_text().strip()
    assert new_id != "0123456789abcdef"
    (loss,) = client.get_metric_history(new_id, "sft/loss")
    assert started * 1000 - 1000 <= loss.timestamp <= time.time() * 1000
    assert json.loads(client.get_run(new_id).data.params["env.options"]) == {"odd key!": 1}


def test_a_failing_sink_is_dropped_and_the_jsonl_goes_on(tmp_path, caplog, monkeypatch):
    sinks = Sinks(tmp_path, config("tensorboard"))
    calls = []

    class Broken:
        def write(self, record):
            calls.append("write")
            raise OSError("disk full")

        def close(self):
            calls.append("close")

    sinks.sinks["broken"] = Broken()
    with caplog.at_level(logging.WARNING, logger="common.metrics"):
        for record in records():
            sinks.write(record)
    sinks.close()
    assert calls == ["write", "close"]  # dropped at its first failure, closed then, not again
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r.message for r in caplog.records].count(
        "metrics sink broken failed (OSError: disk full): dropped; metrics.jsonl goes on") == 1
    assert [s for s, _v in tensorboard_scalars(tmp_path / "tensorboard")["reward/mean"]] == [1, 2, 3, 4]

    # A sink that cannot start stops the start, naming run.metrics, with the others closed.
    import common.metrics

    def refuses(run_dir, cfg):
        raise PermissionError("no access")

    monkeypatch.setitem(common.metrics.SINKS, "wandb", refuses)
    with pytest.raises(RuntimeError, match=r"run.metrics names 'wandb', which could not start: PermissionError: "
                                           r"no access: check run.wandb_mode"):
        Sinks(tmp_path / "again", config("tensorboard", "wandb"))


def test_a_line_a_killed_writer_left_unfinished_is_cut_off_before_the_next(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew')
    sinks = Sinks(tmp_path, config("jsonl"))
    sinks.write({"step": 2, "reward/mean": 0.5})
    sinks.close()
    assert read_jsonl(path) == [{"step": 1}, {"step": 2, "reward/mean": 0.5}]
    path.write_text('{"step": 1, "rew')  # no whole line at all
    Sinks(tmp_path, config("jsonl")).close()
    assert path.read_text() == ""


def test_an_unknown_sink_fails_the_config_and_a_missing_package_fails_the_start(tmp_path, monkeypatch):
    path = tmp_path / "run.toml"
    path.write_text('[run]\nmetrics = ["jsonl", "neptune"]\n')
    with pytest.raises(ConfigError, match=r"run\.metrics"):
        load_config(path)

    import common.metrics
    from deploy.preflight import Failed, check_metrics

    monkeypatch.setitem(common.metrics.SINK_PACKAGES, "wandb", ("omrl_no_such_package",))
    with pytest.raises(Failed) as failed:
        check_metrics(Config.model_validate({"run": {"metrics": ["wandb"]}}), None)
    assert "run.metrics names 'wandb'" in str(failed.value) and "take 'wandb' out of run.metrics" in failed.value.fix
    assert check_metrics(Config(), None) == "metrics.jsonl, tensorboard"  # the default
    monkeypatch.setitem(common.metrics.SINK_PACKAGES, "mlflow", ("mlflow", "omrl_no_such_package"))
    with pytest.raises(Failed) as failed:
        check_metrics(Config.model_validate({"run": {"metrics": ["mlflow"]}}), None)
    assert "the omrl_no_such_package package is not installed" in str(failed.value)
    assert failed.value.fix.startswith("pip install mlflow-skinny sqlalchemy alembic")


def test_read_jsonl_leaves_out_a_line_still_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    path.write_text('{"step": 1}\n{"step": 2}')  # whole, only its newline missing
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    path.write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n')  # a broken line inside is an error
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)


def test_omrl_plot_draws_a_run_at_any_time(tmp_path):
    pytest.importorskip("matplotlib")
    sinks = Sinks(tmp_path, config("jsonl"))
    for record in records():
        sinks.write(record)
    sinks.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')  # the learner is writing its next line
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "plot", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "metrics.png")
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*partial"))
    missing = subprocess.run([sys.executable, "-m", "deploy.cli", "plot", str(tmp_path / "nope")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "metrics.jsonl does not exist" in missing.stderr


@pytest.mark.parametrize("learner", [{}, {"algorithm": "ppo"}, {"kl_coef": 0.1, "minibatches": 2},
                                     {"sft_coef": 0.5, "sft_data": ["episodes.parquet"]}])
def test_every_metric_of_a_training_step_is_in_the_glossary(tiny_model, learner):
    from tests.metrics_doc import undocumented
    from tests.unit.test_trainer import first_step, varied_groups

    _grads, metrics = first_step(tiny_model, varied_groups(), **learner)
    assert len(metrics) > 10 and undocumented(metrics) == []
    assert undocumented(["learner/time/forward_s", "reward/mean", "learner/made_up"]) == ["learner/made_up"]
