"""`omrl bench --quick` as a smoke test: every benchmark writes well-formed figures, a
plot and (for `all`) the markdown table. It checks shapes, never a speed; the pipeline's
runs also check what synchronous mode promises (every group on the learner's current
weights) and that the async run went ahead of the learner."""

import json
import math
import subprocess
import sys

import pytest

from benchmarks.run import BENCHMARKS
from tests.budget import patience


@pytest.mark.slow
def test_bench_all_quick_writes_json_plots_and_table(tmp_path):
    # About 640 s alone on the reference machine (2026-11-27): staleness 177 s, the evaluator
    # 128, the pipeline 97, weights 83, shards 55, scale 42, engine 34, the rest 20.
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "all", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=patience(640))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = 0
    for name in BENCHMARKS:
        result = json.loads((tmp_path / f"{name}.json").read_text())
        assert result["name"] == name and result["quick"] is True and result["machine"]
        assert result["rows"], name
        for row in result["rows"]:
            ratio = row["ratio"]
            assert row["system"] > 0 and row["baseline"] > 0, row
            assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"], row
        rows += len(result["rows"])
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    check_pipeline_runs(json.loads((tmp_path / "pipeline.json").read_text())["runs"])
    check_weights(json.loads((tmp_path / "weights.json").read_text()))
    check_staleness(json.loads((tmp_path / "staleness.json").read_text()))
    check_fanout(json.loads((tmp_path / "fanout.json").read_text()))
    check_scale(json.loads((tmp_path / "scale.json").read_text()))
    table = (tmp_path / "table.md").read_text().splitlines()
    assert table[0].startswith("| benchmark |") and len(table) == 2 + rows


def check_weights(result):
    """A row per transport and figure, and per update-mode figure, each finite and positive;
    every version by broadcast was sent, once per actor."""
    def finite_positive(row):
        r = row["ratio"]
        assert all(math.isfinite(x) and x > 0 for x in (row["system"], row["baseline"], r["median"])), row
        assert 0 < r["min"] <= r["median"] <= r["max"], row

    rows = result["rows"]
    for row in rows:
        finite_positive(row)
    assert {(r["transport"], r["figure"]) for r in rows if "transport" in r} == {
        (t, f) for t in ("blob", "dir", "broadcast") for f in ("MB/s", "s")}
    assert sorted(r["figure"] for r in rows if "transport" not in r and "modes" not in r) == ["publish_file_mb",
                                                                                            "publish_mb"]
    contexts = [at["context"] for at in result["updates"]["contexts"]]
    assert len(contexts) == 2 and {(r["context"], r["figure"], *r["modes"]) for r in rows if "modes" in r} == {
        (c, f, *pair) for c in contexts for f in ("tokens_per_s", "update_s", "blocked_s")
        for pair in (("interrupt", "drain"), ("keep", "drain"), ("keep", "interrupt"))}
    points = {p["transport"]: p for p in result["points"]}
    assert set(points) == {"blob", "dir", "broadcast"}
    for p in points.values():
        assert sum(p["split"].values()) == pytest.approx(p["system_s"]["median"]), p
    broadcast = points["broadcast"]
    assert broadcast["broadcast_sent"] == len(broadcast["system_runs"]) * broadcast["actors"]  # quick: no warm-up
    shape = result["updates"]["shape"]
    for at in result["updates"]["contexts"]:
        assert all(r["applied"] == shape["updates"] and r["tokens"] >= shape["concurrency"] * shape["tokens"]
                   for mode in ("interrupt", "keep", "drain") for r in at["runs"][mode]), at


def check_fanout(result):
    """The broadcast's learner sent one version's bytes per version, with 2 receivers as with 1."""
    sent = [r for r in result["rows"] if "bytes the learner sent" in r["measure"]]
    assert sent and all(r["ratio"]["min"] == r["ratio"]["max"] == 1.0 for r in sent), sent


def test_an_unknown_benchmark_is_refused_with_the_choices():
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "nope"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "invalid choice: 'nope'" in done.stderr and "env" in done.stderr


def check_pipeline_runs(runs):
    sync = [r for r in runs if r["mode"] == "sync"]
    ahead = [r for r in runs if r["mode"] != "sync"]
    assert sync and ahead
    for r in runs:
        assert r["steps"] >= 3 and len(r["rewards"]) == r["steps"]
        assert 0 <= r["learner_busy"] <= 1 and 0 <= r["actor_idle"] <= 1 and r["learner_step_s"] > 0, r
        assert r["cores"] in ("split", "shared")
        assert sum(r["staleness_hist"].values()) == 8 * r["steps"], r  # every trained group, once
    # Sync: trained only on the weights the learner held; async: at least one group generated ahead.
    assert all(set(r["staleness_hist"]) == {"0"} for r in sync), sync
    assert any(set(r["staleness_hist"]) != {"0"} for r in ahead), ahead


def check_scale(result):
    """Both arms took groups in through the real actors and intake; the doorbell's waiters
    sent fewer commands a group than polling's (8 loops already wait at the bound: B = 16,
    eta = 2 let 48 groups run at once, 8 loops' groups outrun a trainer of 16 groups/s)."""
    points = {p["arm"]: p for p in result["points"]}
    assert set(points) == {"doorbell", "polling"}
    for p in points.values():
        assert p["groups"] > 0 and p["groups_per_s"] > 0 and p["commands_per_group"] > 0 and p["admitted"] > 0, p
        assert 0 <= p["wait_p50_s"] <= p["wait_p99_s"] and p["redis_memory_mb"] > 0, p
    assert points["doorbell"]["calls_per_s"].get("blpop", 0) > 0  # they waited on the doorbell
    assert "blpop" not in points["polling"]["calls_per_s"]
    assert set(result["goals"]["met"]) == {"commands_flat", "intake_kept", "redis_under_half_core"}


def check_staleness(result):
    """The synchronous run trains at staleness 0; the asynchronous one ran with the naive loss,
    whose ratio is against the behaviour log-probs (so no behaviour weight: ESS 1), four
    minibatches a step (the study's trust region: the clip acts)."""
    runs = {r["arm"]: r for r in result["runs"]}
    assert set(runs) == {"sync", "naive eta=4"}, runs
    assert runs["sync"]["staleness_max"] == 0 and runs["sync"]["staleness_hist"] == {"0": 8 * result["steps"]}
    naive = runs["naive eta=4"]
    assert naive["ess"] == 1.0 and len(naive["success"]) == len(naive["times"]) == result["steps"]
    assert set(result["summary"]) == set(runs) and result["table"].count("\n") == 2 + len(runs)
    assert result["rows"][0]["measure"] == "naive eta=4 vs sync: optimizer steps per second"
