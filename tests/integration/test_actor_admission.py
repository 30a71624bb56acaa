"""A real actor process (vLLM on CPU, the env server) stops starting groups at the
staleness bound and resumes when the learner publishes a new version (woken by the
publication's doorbell)."""

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.admission import wake_waiting
from broker.connection import connect
from broker.embedded import EmbeddedRedis, free_port
from broker.keys import Keys
from broker.weights import WeightStore

pytestmark = [pytest.mark.redis, pytest.mark.vllm]

B, ETA = 2, 1  # the bound: started < (S + eta + 1) * B, S the newest weights' step


def test_actor_waits_at_the_staleness_bound_and_resumes_on_publish(tmp_path, tiny_model):
    env_port = free_port()
    with EmbeddedRedis() as redis_server:
        config = tmp_path / "run.toml"
        config.write_text(f"""
[run]
run_dir = "{tmp_path / 'run'}"
[redis]
url = "{redis_server.url}"
run = "admission"
max_stream_len = 100
[model]
path = "{tiny_model}"
[env]
port = {env_port}
[actor]
group_size = 2
concurrent_groups = 4
[learner]
groups_per_step = {B}
eta = {ETA}
""")
        log = open(tmp_path / "procs.log", "ab")
        env = subprocess.Popen([sys.executable, "-m", "envs", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
        actor = subprocess.Popen([sys.executable, "-m", "actors", "--config", str(config)], stdout=log,
                                 stderr=subprocess.STDOUT)
        keys = Keys("admission")

        async def stream_len():
            client = connect(redis_server.url)
            n = await client.xlen(keys.rollouts())
            await client.aclose()
            return n

        def wait_for_groups(n: int, timeout: float) -> int:
            deadline = time.monotonic() + timeout
            while asyncio.run(stream_len()) < n and time.monotonic() < deadline:
                assert actor.poll() is None, Path(tmp_path / "procs.log").read_text()[-3000:]
                time.sleep(0.2)
            time.sleep(3)  # time enough to overshoot, if the bound did not hold
            return asyncio.run(stream_len())

        async def publish(version: int):
            client = connect(redis_server.url)
            blob = (Path(tiny_model) / "model.safetensors").read_bytes()
            await WeightStore(client, keys).publish(version, version, blob)  # version v at step v
            await wake_waiting(client, keys, B, ETA)  # as the learner does: rings the waiting groups
            await client.aclose()

        try:
            assert wait_for_groups((0 + ETA + 1) * B, timeout=180) == (0 + ETA + 1) * B  # stopped at the bound
            asyncio.run(publish(1))
            assert wait_for_groups((1 + ETA + 1) * B, timeout=60) == (1 + ETA + 1) * B  # resumed, stopped again
            asyncio.run(publish(3))
            assert wait_for_groups((3 + ETA + 1) * B, timeout=60) == (3 + ETA + 1) * B
            assert "staleness bound reached" in Path(tmp_path / "procs.log").read_text()
        finally:
            for p in (actor, env):
                p.terminate()
                p.wait(30)
