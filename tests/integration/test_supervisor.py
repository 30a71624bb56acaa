"""The supervisor's restart policy on real processes: backoff that doubles, a budget per
process within a window, start failures not retried, the learner's exit code 0 ending the
run, an optional process (the evaluator) given up on while the run goes on, the last lines of
a process's log in every restart message, and nothing left behind in a dead process's group;
a process alive but making no progress (SIGSTOPped, or never up) killed and restarted, and a
stop that costs one timeout whatever hangs."""

import logging
import os
import random
import re
import signal
import sys
import time

import pytest

from common.config import SupervisorConfig
from deploy.supervisor import Process, Supervisor, stop_all
from tests.procs import alive


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
    # The first start exits 143 (stopped by a signal), the restart exits 0 (done).
    learner = python(tmp_path, "learner", "import pathlib, sys; marker = pathlib.Path(sys.argv[-1]); "
                                          "sys.exit(0) if marker.exists() else (marker.touch(), sys.exit(143))")
    learner.args.append(str(tmp_path / "started-once"))
    supervisor = Supervisor(SupervisorConfig(backoff_s=0.3, start_s=0), [learner], learner=learner)
    learner.start()
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
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


BEATING = """
import os, pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
path = pathlib.Path(os.environ["OMRL_BEAT_FILE"])
while True:
    path.touch()  # what common.liveness.beat does
    time.sleep(0.05)
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_a_process_that_stops_making_progress_is_killed_and_restarted_within_hang_s(tmp_path, caplog, seed):
    """SIGSTOP at a random moment: alive, but its beat file goes stale; the supervisor kills it
    within supervisor.hang_s (plus its check's period) and starts it again, saying why."""
    rng = random.Random(seed)
    actor = Process("actor0", [sys.executable, "-c", BEATING], tmp_path / "actor0.log",
                    beat_path=tmp_path / "liveness" / "actor0")
    steady = python(tmp_path, "env-server", "import time; time.sleep(60)")  # no beat file: never judged
    cfg = SupervisorConfig(hang_s=1.0, start_grace_s=30, backoff_s=0.1, start_s=0)
    supervisor = Supervisor(cfg, [actor, steady], learner=None)
    actor.start()
    steady.start()
    try:
        assert run_until(supervisor, timeout=0.5 + rng.random()) is None  # beating: left alone
        assert actor.starts == 1 and actor.alive()
        first = actor.proc.pid
        os.kill(first, signal.SIGSTOP)
        time.sleep(0.05)
        last = actor.beat_path.stat().st_mtime  # its last beat: stopped, it beats no more
        with caplog.at_level(logging.INFO):
            deadline = time.monotonic() + 10
            while actor.starts < 2 and time.monotonic() < deadline:
                assert supervisor.check() is None
                time.sleep(0.02)
        assert actor.starts == 2 and actor.proc.pid != first and not alive(first)
        killed = next(r.created for r in caplog.records if "actor0 made no progress for" in r.getMessage())
        assert 1.0 <= killed - last < 2.5  # hang_s after its last beat, give or take the check's period
        assert "supervisor.hang_s = 1" in caplog.text
        assert "actor0 was killed by SIGKILL (the supervisor's: it made no progress for" in caplog.text
        # The successor beats: its predecessor's stale file does not count against it.
        assert run_until(supervisor, timeout=2) is None and actor.starts == 2 and steady.starts == 1
    finally:
        stop_all([actor, steady], timeout=5)


def test_a_process_that_never_makes_progress_is_taken_as_hung_after_its_start_grace(tmp_path, caplog):
    silent = python(tmp_path, "learner", "import time; time.sleep(60)")
    silent.beat_path = tmp_path / "liveness" / "learner"
    cfg = SupervisorConfig(hang_s=0.5, start_grace_s=1.5, backoff_s=0.1, start_s=0, max_restarts=1)
    supervisor = Supervisor(cfg, [silent], learner=silent)
    silent.start()
    with caplog.at_level(logging.INFO):
        assert run_until(supervisor, timeout=1.2) is None and silent.starts == 1  # still starting
        assert run_until(supervisor, timeout=10) == 1  # twice hung: the restart budget is spent
    assert silent.starts == 2 and "(supervisor.start_grace_s)" in caplog.text
    assert re.search(r"made no progress in the [12]s since its start", caplog.text)
    assert supervisor.failure.startswith("learner was killed by SIGKILL (the supervisor's: it made no progress in")
    # hang_s = 0 turns the check off.
    quiet = python(tmp_path, "actor1", "import time; time.sleep(60)")
    quiet.beat_path = tmp_path / "liveness" / "actor1"
    supervisor = Supervisor(SupervisorConfig(hang_s=0, start_grace_s=0.2, start_s=0), [quiet], learner=None)
    quiet.start()
    try:
        assert run_until(supervisor, timeout=1) is None and quiet.starts == 1
    finally:
        quiet.stop(timeout=5)


def test_stopping_the_run_with_stopped_and_deaf_processes_costs_one_timeout(tmp_path):
    """Ctrl-C with hung processes: every group hears SIGTERM at once (a SIGSTOPped one after the
    SIGCONT that comes with it), and one that ignores it is SIGKILLed when the one wait ends."""
    graceful = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("drained", flush=True), sys.exit(0)))
print("up", flush=True)
time.sleep(60)
"""
    stopped = [python(tmp_path, f"actor{i}", graceful) for i in range(2)]
    deaf = python(tmp_path, "env-server", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                          "print('up', flush=True); time.sleep(60)")
    for p in (*stopped, deaf):
        p.start()
    deadline = time.monotonic() + 20
    while not all("up" in p.tail() for p in (*stopped, deaf)) and time.monotonic() < deadline:
        time.sleep(0.05)  # each has its handler set
    for p in stopped:
        os.kill(p.proc.pid, signal.SIGSTOP)
    began = time.monotonic()
    stop_all([*stopped, deaf], timeout=2.0)
    took = time.monotonic() - began
    assert 2.0 <= took < 4.0, took  # one wait, not one a process
    assert all(p.returncode == 0 and "drained" in p.tail() for p in stopped)  # stopped, yet they heard it
    assert deaf.returncode == -signal.SIGKILL


@pytest.mark.redis
def test_a_stopped_redis_is_found_by_its_pings_and_replaced_and_a_call_to_it_times_out_naming_itself(
        tmp_path, caplog, monkeypatch):
    """The embedded Redis's beats are the PINGs it answers (the supervisor's probe): SIGSTOPped,
    it stops answering, and it is killed and started again on its port with its data. Meanwhile
    a client's call (socket timeout cut to 1 s here, 30 s by default) raises TimeoutError, which
    the retry policy logs naming the call, and succeeds once Redis is back."""
    import asyncio
    import threading

    from broker import connection
    from broker.embedded import EmbeddedRedis
    from broker.retry import RetryPolicy
    from deploy.supervisor import _probe_redis, _wait_redis

    monkeypatch.setattr(connection, "SOCKET_TIMEOUT_S", 1.0)
    server = EmbeddedRedis(appendonly=True, data_dir=str(tmp_path), extra_args=["--appendfsync", "always"])
    redis = Process("redis", server.command(), tmp_path / "redis.log", ready=_wait_redis(server.port),
                    beat_path=tmp_path / "liveness" / "redis")
    supervisor = Supervisor(SupervisorConfig(hang_s=1.5, start_grace_s=10, backoff_s=0.1, start_s=0), [redis], None)
    stop = threading.Event()
    redis.start()
    threading.Thread(target=_probe_redis, args=(server.port, redis.beat_path, stop, 0.1), daemon=True).start()

    async def calls() -> tuple[bytes, float]:
        client = connection.connect(server.url)
        try:
            await client.set("k", b"kept")
            first = redis.proc.pid
            os.kill(first, signal.SIGSTOP)
            stopped = time.monotonic()
            value = await RetryPolicy(attempts=None, timeout_s=30).run("GET k", lambda: client.get("k"))
            assert redis.proc.pid != first
            return value, time.monotonic() - stopped
        finally:
            await client.aclose()

    try:
        assert run_until(supervisor, timeout=0.5) is None and redis.beat_path.exists()
        done: list = []
        caller = threading.Thread(target=lambda: done.append(asyncio.run(calls())))
        with caplog.at_level(logging.INFO):
            caller.start()
            while caller.is_alive():
                assert supervisor.check() is None
                time.sleep(0.02)
        value, waited = done[0]
        assert value == b"kept" and redis.starts == 2  # the same port, the same append-only file
        assert 1.5 <= waited < 10, waited
        assert "redis made no progress for" in caplog.text
        assert re.search(r"GET k failed \((Timeout|Connection)Error", caplog.text), caplog.text
        assert "Timeout reading from" in caplog.text  # the stopped Redis's call ran out its socket timeout
    finally:
        stop.set()
        stop_all([redis], timeout=5)


def test_a_log_past_its_size_is_copied_aside_and_emptied_while_the_process_writes_on(tmp_path, caplog):
    """supervisor.log_max_mb: a process writing numbered lines non-stop. Each rotation leaves
    NAME.log.1 holding a run of earlier lines and NAME.log small, and the process's later lines
    land at the start of the emptied file (it writes in append mode: no hole of zeros where its
    old offset was). Past the last rotation the log holds every line written since, in order."""
    writer = python(tmp_path, "actor0", "import itertools, sys, time\n"
                                        "for i in itertools.count():\n"
                                        "    print(f'line {i:08d} ' + 'x' * 200, flush=True)\n"
                                        "    time.sleep(0.0005)")
    supervisor = Supervisor(SupervisorConfig(log_max_mb=0.25), [writer], learner=None)
    writer.start()
    rotations = 0
    try:
        with caplog.at_level(logging.INFO):
            deadline = time.monotonic() + 60
            while rotations < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
                before = writer.log_path.stat().st_size
                supervisor.rotate_logs(every_s=0)
                rotations += before > 0.25 * 2 ** 20 and writer.log_path.stat().st_size < before
            time.sleep(0.5)  # lines after the last rotation
    finally:
        writer.stop(timeout=5)
    assert rotations == 3, rotations
    assert "actor0's log passed 0.25 MB" in caplog.text
    older = writer.log_path.with_name("actor0.log.1").read_bytes()
    current = writer.log_path.read_bytes()
    assert b"\0" not in current and len(current) < 0.5 * 2 ** 20
    whole = lambda text: [int(line.split()[1]) for line in text.decode().splitlines() if len(line) == 214]  # noqa: E731
    numbers = whole(current)  # the copy may end inside a line; the emptied file begins with a whole one
    assert numbers and numbers == list(range(numbers[0], numbers[0] + len(numbers))), "lines lost or out of order"
    assert whole(older)[-1] < numbers[0]
    assert SupervisorConfig().log_max_mb == 64 and not python(tmp_path, "x", "").rotate_log(0)  # no log yet
