"""`omrl bench soak`'s figures (benchmarks/soak.py): a process group's usage read from /proc
(a child and its own child, as an actor and its vLLM engine), and rows that compare each
series' last tenth with its second."""

import subprocess
import sys
import time

import pytest

from benchmarks.soak import rows, sample_run


def test_a_sample_counts_each_supervised_group_with_its_children(tmp_path):
    # A stand-in for `omrl run`: one child in a session of its own (as the supervisor starts
    # each), which starts a grandchild holding 50 MB and a few threads.
    engine = ("import threading, time; b = bytearray(50 * 2**20); "
              "[threading.Thread(target=time.sleep, args=(60,)).start() for _ in range(3)]; time.sleep(60)")
    actor = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {engine!r}]); time.sleep(60)"
    script = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {actor!r}, '-m', 'actors', "
              f"'--index', '1'], start_new_session=True); time.sleep(60)")
    supervisor = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sample = sample_run(supervisor.pid, tmp_path)
            actor = sample["processes"].get("actor1")
            if actor and actor["processes"] == 2 and actor["rss_mb"] > 50 and actor["threads"] >= 5:
                break
            time.sleep(0.2)
        assert set(sample["processes"]) == {"supervisor", "actor1"}, sample
        assert actor["processes"] == 2 and actor["rss_mb"] > 50 and actor["threads"] >= 5 and actor["files"] >= 3
        assert sample["redis"] == {} and sample["steps"] == 0  # no run there: no Redis, no metrics
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(_session_of_child(supervisor.pid))], check=False)
        supervisor.kill()
        supervisor.wait()


def _session_of_child(pid: int) -> int:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return int(children[0]) if children else -1


def test_rows_compare_the_last_tenth_with_the_second():
    def sample(t: float, rss: float, keys: float) -> dict:
        return {"t": t, "processes": {"learner": {"rss_mb": rss}}, "redis": {"keys": keys}, "disk_mb": 1.0, "steps": t}

    # Memory that doubles during the first tenth (a start), then holds; keys that grow all along.
    samples = [sample(t, 100 if t < 10 else 200, 10 + t) for t in range(100)]
    by_measure = {r["measure"].split(" (")[0]: r for r in rows(samples)}
    assert by_measure["learner rss_mb"]["ratio"]["median"] == 1.0
    assert by_measure["redis keys"]["ratio"]["median"] > 4  # 104.5 against 24.5
    assert by_measure["redis keys"]["per_hour"] == pytest.approx(3600)  # one a second
    assert by_measure["learner rss_mb"]["per_hour"] == 0
    assert by_measure["run dir MB"]["ratio"]["median"] == 1.0 and "steps" not in by_measure
    assert rows([]) == []
