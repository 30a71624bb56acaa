"""The whole system through `omrl run`: real processes, the embedded Redis, the env server,
two vLLM actors on CPU and the learner, on the default tiny model."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.metrics import read_jsonl
from tests.budget import patience
from tests.e2e.learning import fifths

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.redis]


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def omrl(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.timeout(patience(160))
def test_default_run_learns_and_actors_apply_new_weights(tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    # The default run, plus an evaluation on 16 held-out tasks every 40 versions, with weights
    # going by broadcast (one gloo group of the learner and both actors, staged by each actor).
    proc = omrl("run", "--run-dir", str(run_dir), "--set", "learner.eval_every=40", "--set", "learner.eval_tasks=16",
                "--set", 'weights.transport="broadcast"')
    out, _ = proc.communicate(timeout=patience(150))
    elapsed = time.monotonic() - started
    print(out[-4000:])
    print(f"omrl run took {elapsed:.0f}s")
    assert proc.returncode == 0, out[-4000:]

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 20
    for key in ("step", "reward/mean", "weight_version", "staleness/mean", "perf/tokens_per_s"):
        assert all(key in r for r in rows), key
    rewards = [r["reward/mean"] for r in rows]
    reward = fifths(rows, "reward/mean")
    print(f"reward {reward}")
    assert reward.gain >= 0.3, rewards
    assert reward.p < 0.001, rewards  # no order of the same steps' rewards but a learning one does as well

    # Tokens the actors generated carry the weight version they ran on: actors applied new versions.
    versions_used = {v for r in rows for v in (r["batch/version_min"], r["batch/version_max"])}
    assert len({v for v in versions_used if v >= 1}) >= 2, versions_used
    for log in sorted((run_dir / "logs").glob("actor*.log")):
        assert log.read_text().count("by broadcast") >= 2, log
    assert (run_dir / "logs" / "learner.log").read_text().count("joined the weight group") == 2
    # One group for both actors: a version leaves the learner once (again only for a joiner; one
    # published while a send is under way may be skipped for the newer), and each send reaches both.
    last = rows[-1]
    assert last["weights/members"] == 2 and last["weights/sends"] <= last["weight_version"] + 4, last
    assert last["weights/sent"] >= 2 * last["weights/sends"] - 4, last
    assert (run_dir / "metrics.png").stat().st_size > 0
    # Evaluations at the first version, then every 40, reached the learner's step records.
    evals = [r for r in rows if "eval/reward" in r]
    versions = [r["eval/version"] for r in evals]
    assert len(evals) >= 3 and versions[0] < 40 <= versions[1] and versions == sorted(versions), versions
    assert all(r["eval/episodes"] == 16 and 0 <= r["eval/success"] <= 1 for r in evals)
    assert evals[-1]["eval/reward"] > evals[0]["eval/reward"]  # greedy on held-out tasks, it learned too
    assert all(r["actor/invalid_action_frac"] == 0 for r in rows)  # the raw template parses everything
    # The default trust region (4 minibatch updates a batch, issue 26): the clip acts.
    clipped = [r["learner/frac_clipped"] for r in rows]
    assert sum(c > 0 for c in clipped) >= len(rows) // 10, clipped  # 70 of 160 steps in a default run
    assert processes_mentioning(str(run_dir)) == []

    # The trained model, saved at the end, evaluated greedily on the held-out tasks.
    final = run_dir / "final"
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "eval", "--model", str(final), "--env", "letters",
                           "--episodes", "64", "--out", str(tmp_path / "eval.json")],
                          capture_output=True, text=True, timeout=300)
    print(done.stdout[-1000:])
    assert done.returncode == 0, done.stderr[-3000:]
    [result] = json.loads((tmp_path / "eval.json").read_text())
    assert result["episodes"] == 64 and result["reward"] > evals[0]["eval/reward"] + 0.2, result


@pytest.mark.timeout(patience(80))
def test_ctrl_c_stops_every_process_and_two_ranks_resume_on_one(tmp_path):
    """The learner runs as 2 FSDP2 ranks under torchrun; Ctrl-C stops every process (the
    ranks included) after a commit; the run then resumes from that checkpoint on 1 rank."""
    run_dir, shared = tmp_path / "run", tmp_path / "shared"
    # Weights as files in a shared directory (weights.dir) rather than in Redis.
    proc = omrl("run", "--run-dir", str(run_dir), "--steps", "1000", "--set", "learner.ranks=2",
                "--set", 'learner.parallel="fsdp2"', "--set", f'weights.dir="{shared}"')
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step 2 " in line:
            break
    assert any("step 2 " in line for line in lines), "".join(lines[-30:])
    assert len(processes_mentioning(str(run_dir))) >= 4  # env server, learner, two actors
    assert len(processes_mentioning(str(run_dir))) >= 6  # env server, torchrun and its 2 ranks, two actors
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert processes_mentioning(str(run_dir)) == []
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "rank 1 of 2 on cpu (gloo)" in learner_log and "(fsdp2)" in learner_log
    stopped_at = max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl"))

    done = subprocess.run([sys.executable, "-m", "deploy.cli", "run", "--run-dir", str(run_dir),
                           "--steps", str(stopped_at + 2), "--set", f'weights.dir="{shared}"'],
                          capture_output=True, text=True, timeout=patience(40))
    assert done.returncode == 0, done.stdout[-3000:]
    # The stop committed its last step; one rank read the checkpoint that two ranks wrote.
    assert f"step-{stopped_at:08d}: step {stopped_at}," in (run_dir / "logs" / "learner.log").read_text()
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps[-2:] == [stopped_at + 1, stopped_at + 2], steps  # went on from the 2-rank checkpoint
    files = sorted(shared.glob("v*.safetensors"))
    assert 1 <= len(files) <= 3 and not list(shared.glob("*.tmp-*"))  # the last learner.keep_versions, whole
    assert "applied weight version" in (run_dir / "logs" / "actor0.log").read_text()
    assert processes_mentioning(str(run_dir)) == []
