"""The beat file (common/liveness.py): what a process touches while it makes progress, and the
health check that reads it. The supervisor's use: tests/integration/test_supervisor.py."""

import os
import time

from common import liveness


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
