"""The beat file (common/liveness.py): what a process touches while it makes progress, and the
health check that reads it; die_with_parent, which stops a child with its killed parent. The
supervisor's use: tests/integration/test_supervisor.py."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import liveness
from tests.procs import alive


def test_the_health_check_reads_the_beat_file(tmp_path, monkeypatch, capsys):
    path = tmp_path / "actor0"
    assert liveness.main([str(path), "5"]) == 1 and "no beat yet" in capsys.readouterr().err
    monkeypatch.setenv(liveness.ENV, str(path))
    liveness.beat()
    assert liveness.main([str(path), "5"]) == 0
    os.utime(path, (time.time() - 60, time.time() - 60))
    assert liveness.main([str(path), "5"]) == 1 and "no progress for 60s" in capsys.readouterr().err
    monkeypatch.delenv(liveness.ENV)
    liveness.beat()  # unset: nothing, anywhere
    assert liveness.main([str(path), "5"]) == 1 and liveness.main([]) == 2


PARENT = """
import subprocess, sys, time
from common.liveness import die_with_parent
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
guarded = subprocess.Popen(sleep, start_new_session=True, preexec_fn=die_with_parent)
unguarded = subprocess.Popen(sleep, start_new_session=True)
print(guarded.pid, unguarded.pid, flush=True)
time.sleep(600)
"""


def test_a_child_started_with_die_with_parent_stops_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    guarded, unguarded = map(int, parent.stdout.readline().split())
    try:
        parent.kill()  # SIGKILL: no handler of the parent's runs
        parent.wait()
        deadline = time.monotonic() + 10
        while alive(guarded) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(guarded), "the guarded child outlived its parent"
        time.sleep(0.5)
        assert alive(unguarded)  # the control: a child in its own session survives a killed parent
    finally:
        for pid in (guarded, unguarded):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

