"""Recovery paths on real Redis servers: producers riding out an outage with their local
buffer, entries delivered too often going to the dead letters, and `omrl status`."""

import asyncio
import json
import subprocess
import sys
import time

import numpy as np
import pytest
from redis.exceptions import ConnectionError

from broker.admission import Admission
from broker.connection import connect
from broker.embedded import EmbeddedRedis, find_redis_server, free_port
from broker.keys import Keys
from broker.membership import Membership
from broker.retry import RetryPolicy
from broker.streams import RolloutConsumer, RolloutProducer
from broker.weights import WeightStore
from common.config import RedisConfig
from common.messages import encode_group
from learner.bridge import BrokerBridge
from tests.groups import synthetic_group

pytestmark = pytest.mark.redis


def test_producer_buffers_while_redis_is_down_and_delivers_everything_after(tmp_path, run_name):
    port = free_port()
    keys = Keys(run_name)

    async def scenario():
        client = connect(f"redis://127.0.0.1:{port}/0")
        producer = RolloutProducer(client, keys, max_len=100, buffer_size=3,
                                   retry=RetryPolicy(attempts=100, base_delay_s=0.05, max_delay_s=0.2))
        flusher = asyncio.create_task(producer.run())
        for i in range(4):
            await producer.push(b"g%d" % i)  # one with the flusher, three in the buffer: returns at once
        await asyncio.sleep(0.3)
        fifth = asyncio.create_task(producer.push(b"g4"))
        await asyncio.sleep(0.5)
        assert not fifth.done() and producer.buffered == 3  # buffer full: the producer waits, drops nothing
        with EmbeddedRedis(binary=find_redis_server("bundled"), port=port, data_dir=str(tmp_path)):
            await asyncio.wait_for(fifth, 10)
            await asyncio.wait_for(producer.flush(), 10)
            entries = await client.xrange(keys.rollouts())
            flusher.cancel()
            await client.aclose()
            return [fields[b"g"] for _, fields in entries]

    # g0 was taken by the flusher and is retried; the rest wait in the buffer: all arrive, in order.
    assert asyncio.run(scenario()) == [b"g0", b"g1", b"g2", b"g3", b"g4"]


def test_retry_policy_gives_up_and_reraises():
    calls = []

    async def failing():
        calls.append(1)
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        asyncio.run(RetryPolicy(attempts=3, base_delay_s=0.001).run("test call", failing))
    assert len(calls) == 3


def test_entry_delivered_too_often_goes_to_the_dead_letters(redis_server_url, run_name):
    cfg = RedisConfig(url=redis_server_url, run=run_name, max_deliveries=3, claim_idle_s=0.2, janitor_every_s=0.2)
    keys = Keys(run_name)
    good, poison = synthetic_group(np.random.default_rng(1)), synthetic_group(np.random.default_rng(2))

    async def deliver_poison_four_times():
        client = connect(redis_server_url)
        consumer = RolloutConsumer(client, keys, "crashy")
        await consumer.ensure_group()
        await client.xadd(keys.rollouts(), {b"g": encode_group(poison)})
        for _ in range(4):  # a consumer that crashes on it every time
            consumer.rewind()
            assert len(await consumer.read(10, block_ms=100)) == 1
        await client.xadd(keys.rollouts(), {b"g": encode_group(good)})
        await client.aclose()

    asyncio.run(deliver_poison_four_times())
    time.sleep(0.3)
    bridge = BrokerBridge(cfg, consumer="learner-0", keep_versions=2, queue_size=8, read_count=8).start()
    try:
        d = bridge.get(timeout=10)
        assert d is not None and d.group.group_id == good.group_id
        deadline = time.monotonic() + 10
        while bridge.dead_letters.get("max_deliveries", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bridge.dead_letters == {"max_deliveries": 1}
        bridge.ack([d])
    finally:
        bridge.stop()

    async def dead():
        client = connect(redis_server_url)
        rows = await client.xrange(keys.dead_letters)
        await client.aclose()
        return rows

    [(_, fields)] = asyncio.run(dead())
    assert fields[b"reason"] == b"max_deliveries" and b"delivered 5 times" == fields[b"detail"]


def test_entries_waiting_for_room_in_the_queue_are_never_claimed(redis_server_url, run_name):
    """One read brings more entries than the bridge's queue holds; the learner takes none for
    many claim_idle_s (a slow step, a checkpoint). The entries still waiting for room are this
    learner's: the janitor must not claim them (each claim is a delivery, and max_deliveries
    then dead-letters good groups after restarts)."""
    cfg = RedisConfig(url=redis_server_url, run=run_name, max_deliveries=2, claim_idle_s=0.1, janitor_every_s=0.05)
    keys = Keys(run_name)
    groups = [synthetic_group(np.random.default_rng(i)) for i in range(6)]

    async def push():
        client = connect(redis_server_url)
        await RolloutConsumer(client, keys, "learner-0").ensure_group()
        for g in groups:
            await client.xadd(keys.rollouts(), {b"g": encode_group(g)})
        await client.aclose()

    async def deliveries():
        client = connect(redis_server_url)
        rows = await client.xpending_range(keys.rollouts(), keys.consumer_group, min="-", max="+", count=100)
        await client.aclose()
        return sorted(int(r["times_delivered"]) for r in rows)

    asyncio.run(push())
    bridge = BrokerBridge(cfg, consumer="learner-0", keep_versions=2, queue_size=2, read_count=6).start()
    try:
        time.sleep(1.5)  # 15 claim_idle_s with a full queue and four entries waiting for room
        assert asyncio.run(deliveries()) == [1] * 6  # nothing claimed: each delivered once
        taken = [bridge.get(timeout=5) for _ in groups]
        assert [d.group.group_id for d in taken] == [g.group_id for g in groups]
        bridge.ack(taken)
        assert bridge.dead_letters == {}
    finally:
        bridge.stop()


def test_omrl_status_reports_streams_dead_letters_actors_and_learner(redis_server_url, run_name):
    keys = Keys(run_name)

    async def prepare():
        client = connect(redis_server_url)
        consumer = RolloutConsumer(client, keys, "learner-0")
        await consumer.ensure_group()
        admission = Admission(client, keys, groups_per_step=4, eta=1)
        for i in range(5):
            assert await admission.try_acquire(f"actor-a|1|{i}")
        for i in range(3):
            await client.xadd(keys.rollouts(), {b"g": b"x%d" % i})
            await admission.commit(f"actor-a|1|{i}")
        await admission.release("actor-a|1|3", "env_error")
        [(e, d, _)] = await consumer.read(1, block_ms=100)
        await consumer.dead_letter(e, d, "undecodable", "test")
        await consumer.read(1, block_ms=100)  # one delivered, not acknowledged
        await WeightStore(client, keys).publish(7, 14, b"w")
        await client.hset(keys.learner_state, mapping={"step": 14, "version": 7})
        members = Membership(client, keys)
        await members.heartbeat("actor-a", role="actor", host="h1", version=7, groups=12, tokens_per_s=100.0)
        await client.hset(keys.members, "actor-b", json.dumps({"id": "actor-b", "last_seen": time.time() - 999,
                                                               "host": "h2", "version": 3}))
        await client.aclose()

    asyncio.run(prepare())
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "status", "--redis-url", redis_server_url,
                          "--run", run_name], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "learner: step 14, version 7" in text
    assert f"stream omrl:{{{run_name}}}:rollouts: length 2, pending 1, lag 1" in text
    assert "dead letters: undecodable 1" in text
    assert ("groups: 5 started = 3 produced + 1 failed (env_error 1) + 1 running; produced = 0 trained + "
            "1 dead-lettered (undecodable 1) + 2 waiting in the streams\n") in text
    assert "actors: 1 live, 1 dead" in text and "actor-b" in text and "DEAD" in text
    js = subprocess.run([sys.executable, "-m", "deploy.cli", "status", "--redis-url", redis_server_url,
                         "--run", run_name, "--json"], capture_output=True, text=True, timeout=60)
    status = json.loads(js.stdout)
    assert status["weights"]["version"] == 7 and status["groups"]["dead_lettered"] == {"undecodable": 1}
    assert status["groups"]["unaccounted"] == 0


def test_janitor_reports_dead_actors_and_forgets_long_dead_ones(redis_server_url, run_name, caplog):
    """Members are keyed by a name that outlives restarts; one silent for longer than
    redis.consumer_gone_s is removed, so the members hash stays flat over days."""
    keys = Keys(run_name)

    async def prepare():
        client = connect(redis_server_url)
        for name, silent_s in (("host-0", 1), ("host-1", 60), ("host-2", 5000)):
            await client.hset(keys.members, name, json.dumps({"id": name, "last_seen": time.time() - silent_s}))
        await client.aclose()

    async def names():
        client = connect(redis_server_url)
        out = sorted(k.decode() for k in await client.hkeys(keys.members))
        await client.aclose()
        return out

    asyncio.run(prepare())
    cfg = RedisConfig(url=redis_server_url, run=run_name, janitor_every_s=0.1, dead_after_s=15, consumer_gone_s=3600)
    bridge = BrokerBridge(cfg, consumer="learner-0", keep_versions=2, queue_size=8, read_count=8).start()
    try:
        deadline = time.monotonic() + 10
        while asyncio.run(names()) != ["host-0", "host-1"] and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        bridge.stop()
    assert asyncio.run(names()) == ["host-0", "host-1"]
    assert "actor host-1 is dead: no heartbeat for 60s" in caplog.text


def test_bridge_survives_a_redis_that_lost_its_data(redis_server_url, run_name):
    """A Redis restarted without persistence has no stream and no consumer group: the
    readers and the janitor must not fail on NOGROUP; the group is created again."""
    cfg = RedisConfig(url=redis_server_url, run=run_name, janitor_every_s=0.05, claim_idle_s=0.05)
    keys = Keys(run_name)
    rng = np.random.default_rng(3)

    async def push(n):
        client = connect(redis_server_url)
        groups = [synthetic_group(rng) for _ in range(n)]
        for g in groups:
            await client.xadd(keys.rollouts(), {b"g": encode_group(g)})
        await client.aclose()
        return [g.group_id for g in groups]

    async def lose_everything():
        client = connect(redis_server_url)
        await client.delete(*[k async for k in client.scan_iter(match=f"omrl:{{{run_name}}}*")])
        await client.aclose()

    bridge = BrokerBridge(cfg, consumer="learner-0", keep_versions=2, queue_size=8, read_count=8).start()
    try:
        first = asyncio.run(push(2))
        got = [bridge.get(timeout=10) for _ in first]
        assert [d.group.group_id for d in got] == first
        asyncio.run(lose_everything())
        time.sleep(0.5)  # readers and janitor meet NOGROUP several times
        bridge.check()
        later = asyncio.run(push(3))
        got = [bridge.get(timeout=10) for _ in later]
        assert [d.group.group_id for d in got if d] == later
        bridge.check()
    finally:
        bridge.stop()
