"""Partitions through `omrl run`: Redis, then the env server, unreachable for 40 s each
mid-run (a TCP proxy of ours in front of each that stops carrying anything, as a dropped
link does: tests/partition.py), each at a random moment (the seed is printed). The run must
finish its steps and exit 0 with no process restarted, the partitions costing at most the
groups in flight, and its books must balance to the group. 40 s: past the Redis clients' socket
timeout (30 s), so calls time out and are retried on new connections while the old ones' bytes
still wait to be delivered."""

import json
import random
import subprocess
import sys
import time

import pytest

from broker.embedded import EmbeddedRedis, find_redis_server, free_port
from common.metrics import last_step, read_jsonl
from common.retry import wait_http
from tests.budget import patience
from tests.partition import Partition
from tests.procs import processes_mentioning

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.redis]

STEPS, B = 60, 8
CUT_S = 40
# What a partition may cost: the groups in flight, with the reason their env calls gave.
FAILURE_REASONS = {"env_unreachable", "env_timeout", "env_error", "cancelled"}  # cancelled: the end's


@pytest.mark.timeout(patience(240))
def test_a_run_rides_out_a_partition_from_redis_and_one_from_the_env_server(tmp_path):
    seed = random.randrange(10_000)
    print(f"partition seed {seed}")
    rng = random.Random(seed)
    run_dir, env_port = tmp_path / "run", free_port()
    env = subprocess.Popen([sys.executable, "-m", "deploy.cli", "env-server", "--port", str(env_port)],
                           stdout=open(tmp_path / "env.log", "w"), stderr=subprocess.STDOUT)
    out = open(tmp_path / "omrl.out", "w+")
    proc = None
    try:
        with EmbeddedRedis(binary=find_redis_server(), data_dir=str(tmp_path)) as redis, \
                Partition(redis.port) as to_redis, Partition(env_port) as to_env:
            wait_http(f"http://127.0.0.1:{env_port}/", 120, env.poll)
            proc = subprocess.Popen(
                [sys.executable, "-m", "deploy.cli", "run", "--run-dir", str(run_dir), "--steps", str(STEPS),
                 "--set", f"redis.url='redis://127.0.0.1:{to_redis.port}/0'",
                 "--set", f"env.url='http://127.0.0.1:{to_env.port}'", "--set", "learner.eval_every=0"],
                stdout=out, stderr=subprocess.STDOUT, text=True)

            def steps() -> int:
                return last_step(run_dir)

            def wait_for_step(step: int, timeout: float = 300) -> None:
                deadline = time.monotonic() + timeout
                while steps() < step:
                    assert proc.poll() is None, f"omrl run ended before step {step}:\n{_tail(out)}"
                    assert time.monotonic() < deadline, f"no step {step} in {timeout:.0f}s:\n{_tail(out)}"
                    time.sleep(0.2)

            for name, link in (("redis", to_redis), ("env server", to_env)):
                wait_for_step(steps() + 3 + rng.randrange(4), timeout=600 if name == "redis" else 300)
                time.sleep(rng.random() * 1.5)
                at = steps()
                assert at < STEPS - 10, "the run is nearly over before its partition: raise STEPS"
                link.cut()
                print(f"cut the link to {name} at step {at} for {CUT_S}s", flush=True)
                time.sleep(CUT_S)
                during = steps()
                link.heal()
                print(f"healed it at step {during}", flush=True)
                # The cut is real: the learner trains what was already on its side of it (its queue,
                # two steps; for the env, the streams' two more), not the 40-odd steps of 40 s.
                assert during - at <= 6, (name, at, during)
                wait_for_step(during + 3)  # it goes on by itself
            assert proc.wait(600) == 0, _tail(out)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        env.terminate()
        env.wait(30)
    text = _tail(out, 200_000)
    # No process died or was restarted for it; every step was trained.
    assert "restarting " not in text and "made no progress" not in text, text[-5000:]
    assert sorted({r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")}) == list(range(1, STEPS + 1))
    books = json.loads((run_dir / "accounting.json").read_text())
    print(books)
    assert books["unaccounted"] == 0 and set(books["failed"]) <= FAILURE_REASONS, books
    assert books["started"] == books["produced"] + sum(books["failed"].values()) + books["held"], books
    assert books["trained"] == STEPS * B, books
    assert processes_mentioning(str(run_dir)) == []


def _tail(out, chars: int = 5000) -> str:
    out.flush()
    out.seek(0)
    return out.read()[-chars:]
