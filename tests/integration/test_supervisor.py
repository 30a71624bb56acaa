"""The supervisor's restart policy on real processes: backoff that doubles, a budget per
process within a window, start failures not retried, the learner's exit code 0 ending the
run, an optional process (the evaluator) given up on while the run goes on, the last lines of
a process's log in every restart message, and nothing left behind in a dead process's group."""

import logging
import os
import sys
import time

import pytest

from common.config import SupervisorConfig
from deploy.supervisor import Process, Supervisor


def python(tmp_path, name: str, code: str) -> Process:
    return Process(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")


def run_until(supervisor: Supervisor, timeout: float = 20) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        outcome = supervisor.check()
        if outcome is not None:
            return outcome
        time.sleep(0.02)
    return None


def test_restarts_back_off_and_stop_when_the_budget_is_spent(tmp_path, caplog):
    crashing = python(tmp_path, "actor0", "import sys; print('boom: the env went away', flush=True); sys.exit(3)")
    steady = python(tmp_path, "env-server", "import time; time.sleep(60)")
    cfg = SupervisorConfig(max_restarts=3, backoff_s=0.2, backoff_max_s=0.5, start_s=0)
    supervisor = Supervisor(cfg, [crashing, steady], learner=None)
    for p in (crashing, steady):
        p.start()
    with caplog.at_level(logging.INFO):
        assert run_until(supervisor) == 1
    try:
        assert crashing.starts == 4 and steady.starts == 1
        starts = [r.created for r in caplog.records if r.getMessage().startswith("restarting actor0")]
        exits = [r.created for r in caplog.records if "actor0 exited with code 3; restart" in r.getMessage()]
        delays = [s - e for s, e in zip(starts, exits)]
        assert [round(d, 1) for d in delays] == pytest.approx([0.2, 0.4, 0.5], abs=0.1)  # doubling, capped
        assert "restart 1 of at most 3" in caplog.text and "boom: the env went away" in caplog.text
        assert "actor0 exited with code 3; stopping the run: it used its restart budget (3 restarts" in caplog.text
        assert supervisor.failure.startswith("actor0 exited with code 3, and it used its restart budget")
        assert supervisor.failure.endswith(f"its log: {crashing.log_path}")
    finally:
        steady.stop(timeout=5)


def test_restarts_older_than_the_window_no_longer_count(tmp_path):
    flaky = python(tmp_path, "learner", "import time, sys; time.sleep(0.3); sys.exit(1)")
    cfg = SupervisorConfig(max_restarts=1, restart_window_s=0.2, backoff_s=0, start_s=0)
    supervisor = Supervisor(cfg, [flaky], learner=flaky)
    flaky.start()
    assert run_until(supervisor, timeout=3) is None  # it keeps dying, but never twice within 0.2 s
    assert flaky.starts >= 4
    flaky.stop(timeout=5)


def test_a_start_failure_or_restart_never_stops_the_run_at_once(tmp_path, caplog):
    bad = python(tmp_path, "actor1", "raise SystemExit('error: model.path does not exist')")
    supervisor = Supervisor(SupervisorConfig(start_s=30), [bad], learner=None)
    bad.start()
    with caplog.at_level(logging.ERROR):
        assert run_until(supervisor) == 1
    assert bad.starts == 1 and "after its first start" in caplog.text and "model.path does not exist" in caplog.text

    once = python(tmp_path, "env-server", "import time; time.sleep(0.2)")
    supervisor = Supervisor(SupervisorConfig(restart="never", start_s=0), [once], learner=None)
    once.start()
    assert run_until(supervisor) == 1 and once.starts == 1


def test_an_optional_process_that_cannot_be_kept_up_is_given_up_and_the_run_goes_on(tmp_path, caplog):
    evaluator = python(tmp_path, "evaluator", "import sys; print('CUDA out of memory', flush=True); sys.exit(1)")
    evaluator.optional = True
    steady = python(tmp_path, "learner", "import time; time.sleep(60)")
    cfg = SupervisorConfig(max_restarts=2, backoff_s=0.05, start_s=0)
    supervisor = Supervisor(cfg, [evaluator, steady], learner=steady)
    for p in (evaluator, steady):
        p.start()
    try:
        with caplog.at_level(logging.ERROR):
            assert run_until(supervisor, timeout=3) is None  # the run goes on
        assert evaluator.given_up and evaluator.starts == 3 and supervisor.failure is None
        assert "evaluator exited with code 1; the run goes on without it: it used its restart budget" in caplog.text
        assert "CUDA out of memory" in caplog.text and steady.returncode is None
        first = python(tmp_path, "evaluator", "raise SystemExit('error: no held-out tasks')")  # its first start
        first.optional = True
        supervisor = Supervisor(SupervisorConfig(start_s=30), [first, steady], learner=steady)
        first.start()
        assert run_until(supervisor, timeout=2) is None and first.given_up and first.starts == 1
    finally:
        steady.stop(timeout=5)


def test_the_learners_exit_code_zero_ends_the_run_any_other_restarts_it(tmp_path):
    learner = python(tmp_path, "learner", "import os, sys; sys.exit(0 if os.path.exists(sys.argv[-1]) else 143)")
    marker = tmp_path / "second-start"
    learner.args.append(str(marker))
    supervisor = Supervisor(SupervisorConfig(backoff_s=0.3, start_s=0), [learner], learner=learner)
    learner.start()
    time.sleep(0.1)
    marker.touch()  # the first start exits 143 (stopped by a signal), the restart exits 0 (done)
    assert run_until(supervisor) == 0 and learner.starts == 2


def test_a_dead_process_leaves_nothing_behind_in_its_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    parent = python(tmp_path, "actor0", f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open({str(pid_file)!r}, "w").write(str(child.pid))
time.sleep(0.3)
sys.exit(1)  # dies; its child (think vLLM's engine process) would live on
""")
    supervisor = Supervisor(SupervisorConfig(restart="never", start_s=0), [parent], learner=None)
    parent.start()
    assert run_until(supervisor) == 1
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
    finally:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
