"""`omrl watch ROLE` (compose's entry to every role): a real env server under it. SIGSTOPped at
a random moment (seed printed), it is killed and watch exits 1 within supervisor.hang_s of its
last beat, saying why, for the container's restart policy to act; SIGTERM to watch stops the
role and watch exits with its code; a bad supervisor field fails at start, naming it."""

import os
import random
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from broker.embedded import free_port
from common.liveness import ENV as BEAT_ENV
from tests.procs import alive


def watch(tmp_path, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", "watch", "env-server", "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, BEAT_ENV: str(tmp_path / "beat")})


def up(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).read()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the env server did not come up")


def role_pid(watcher: int) -> int:
    children = subprocess.run(["pgrep", "-P", str(watcher)], capture_output=True, text=True).stdout.split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.parametrize("seed", [0, 1])
def test_a_hung_role_is_killed_and_watch_exits_1_within_hang_s(tmp_path, seed):
    rng = random.Random(seed)
    print(f"seed {seed}")
    port = free_port()
    proc = watch(tmp_path, port, "--set", "supervisor.hang_s=2", "--set", "supervisor.start_grace_s=60")
    try:
        up(port, proc)
        time.sleep(rng.uniform(0.5, 2.0))  # beating: left alone
        assert proc.poll() is None
        role = role_pid(proc.pid)
        os.kill(role, signal.SIGSTOP)
        time.sleep(0.05)
        last = (tmp_path / "beat").stat().st_mtime
        out, _ = proc.communicate(timeout=30)
        ended = time.time()
        assert proc.returncode == 1, out
        assert 2.0 <= ended - last < 4.5, (ended - last, out)
        assert "env-server made no progress for" in out and "supervisor.hang_s = 2" in out
        assert not alive(role)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_sigterm_stops_the_role_and_watch_exits_with_its_code(tmp_path):
    port = free_port()
    proc = watch(tmp_path, port)
    try:
        up(port, proc)
        role = role_pid(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "passing SIGTERM on to env-server" in out and not alive(role)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_bad_supervisor_field_fails_at_start_naming_it(tmp_path):
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "watch", "actor", "--set", "supervisor.hang_s=-1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "supervisor.hang_s" in done.stderr, done.stderr
