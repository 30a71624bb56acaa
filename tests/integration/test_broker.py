"""The rollouts streams, recovery and the weight store on real Redis servers (6.2 and 7)."""

import asyncio

import pytest

from broker.admission import Admission, floor_started
from broker.connection import connect
from broker.keys import Keys
from broker.membership import Membership
from broker.retry import RetryPolicy
from broker.streams import RolloutConsumer, RolloutProducer, stream_info
from broker.weights import WeightStore, WeightVersionError

pytestmark = pytest.mark.redis


class Setup:
    """A client, a producer with its flusher running, and consumer c1 of the learner group."""

    def __init__(self, url, run_name, max_len=100, shards=1):
        self.client = connect(url, blocking=True)
        self.keys = Keys(run_name, shards)
        self.producer = RolloutProducer(self.client, self.keys, max_len, retry=RetryPolicy(attempts=3))
        self.consumer = RolloutConsumer(self.client, self.keys, "c1")

    async def __aenter__(self):
        await self.consumer.ensure_group()
        await self.consumer.ensure_group()  # idempotent
        self.flusher = asyncio.create_task(self.producer.run())
        return self

    async def __aexit__(self, *exc):
        self.flusher.cancel()
        await self.client.aclose()

    async def push(self, *payloads: bytes) -> list[str]:
        before = {e for e, _ in await self.client.xrange(self.keys.rollouts())}
        for p in payloads:
            await self.producer.push(p)
        await self.producer.flush()
        return [e.decode() for e, _ in await self.client.xrange(self.keys.rollouts()) if e not in before]


def run(coro):
    return asyncio.run(coro)


def test_delivery_then_ack_deletes(redis_server_url, run_name):
    async def scenario():
        async with Setup(redis_server_url, run_name) as s:
            ids = await s.push(b"group-0", b"group-1", b"group-2")
            got = await s.consumer.read(10, block_ms=100)
            assert [e for e, _ in got] == ids and [d for _, d in got] == [b"group-0", b"group-1", b"group-2"]
            assert await s.consumer.read(10, block_ms=100) == []  # nothing new
            await s.consumer.ack(ids[:2])
            assert await s.client.xlen(s.keys.rollouts()) == 1  # acked entries are deleted, the unacked stays
            info = await stream_info(s.client, s.keys, 0)
            assert (info["length"], info["pending"], info["lag"]) == (1, 1, 0)
    run(scenario())


def test_restarted_consumer_rereads_its_pending_entries_first(redis_server_url, run_name):
    async def scenario():
        async with Setup(redis_server_url, run_name) as s:
            first = await s.push(b"a", b"b")
            assert len(await s.consumer.read(10, block_ms=100)) == 2  # delivered, then the consumer "dies"
            later = await s.push(b"c")
            restarted = RolloutConsumer(s.client, s.keys, "c1")
            assert [e for e, _ in await restarted.read(10, block_ms=100)] == first
            assert await restarted.delivery_count(first[0]) == 2
            await restarted.ack(first)
            assert [e for e, _ in await restarted.read(10, block_ms=100)] == later
    run(scenario())


def test_pending_entry_whose_payload_was_deleted_comes_back_empty(redis_server_url, run_name):
    async def scenario():
        async with Setup(redis_server_url, run_name) as s:
            [entry] = await s.push(b"x")
            await s.consumer.read(10, block_ms=100)
            await s.client.xdel(s.keys.rollouts(), entry)
            restarted = RolloutConsumer(s.client, s.keys, "c1")
            assert await restarted.read(10, block_ms=100) == [(entry, None)]
    run(scenario())


def test_janitor_claims_idle_entries_of_a_dead_consumer_in_both_reply_shapes(redis_server_url, run_name):
    async def scenario():
        async with Setup(redis_server_url, run_name) as s:
            ids = await s.push(b"a", b"b", b"c")
            dead = RolloutConsumer(s.client, s.keys, "dead")
            await dead.read(10, block_ms=100)
            await s.client.xdel(s.keys.rollouts(), ids[1])  # one payload vanishes while pending
            await asyncio.sleep(0.2)
            janitor = RolloutConsumer(s.client, s.keys, "janitor")
            janitor.reading_pending = False
            claimed = await janitor.claim_idle(min_idle_ms=100)
            assert claimed == [(ids[0], b"a"), (ids[2], b"c")]
            # The deleted entry: Redis 7 drops it from the pending list; 6.2 keeps it, and the
            # janitor's next read of its own pending entries returns it with no payload.
            leftovers = [e for e in await janitor.read(10, block_ms=100) if e[1] is None]
            assert leftovers in ([], [(ids[1], None)])
            await janitor.ack([ids[0], ids[2]] + [e for e, _ in leftovers])
            assert (await stream_info(s.client, s.keys, 0))["pending"] == 0
            assert await janitor.delivery_count(ids[0]) == 0  # acknowledged: no longer pending
            assert await janitor.remove_gone_consumers(idle_ms=100) == ["dead"]  # idle, holding nothing
            names = {c["name"] for c in await s.client.xinfo_consumers(s.keys.rollouts(), s.keys.consumer_group)}
            assert b"dead" not in names and b"janitor" in names
    run(scenario())


def test_dead_letter_keeps_payload_and_reason(redis_server_url, run_name):
    async def scenario():
        async with Setup(redis_server_url, run_name) as s:
            [entry] = await s.push(b"\xff garbage")
            [(got, data)] = await s.consumer.read(10, block_ms=100)
            await s.consumer.dead_letter(got, data, "undecodable", "not a msgpack message")
            [(_, fields)] = await s.client.xrange(s.keys.dead_letters)
            assert fields[b"reason"] == b"undecodable" and fields[b"data"] == b"\xff garbage"
            assert fields[b"entry"] == entry.encode() and fields[b"stream"] == s.keys.rollouts().encode()
            assert await s.client.xlen(s.keys.rollouts()) == 0
    run(scenario())


def test_producer_waits_while_the_stream_is_full(redis_server_url, run_name):
    async def scenario():
        async with Setup(redis_server_url, run_name, max_len=2) as s:
            await s.push(b"1", b"2")
            await s.producer.push(b"3")
            await asyncio.sleep(0.3)
            assert s.producer.buffered == 0 and await s.client.xlen(s.keys.rollouts()) == 2  # waits, trims nothing
            got = await s.consumer.read(2, block_ms=100)
            await s.consumer.ack([e for e, _ in got])
            await asyncio.wait_for(s.producer.flush(), 5)
            assert [d for _, d in await s.consumer.read(10, block_ms=100)] == [b"3"]
    run(scenario())


def test_admission_tickets_bound_staleness(redis_server_url, run_name):
    async def scenario():
        client = connect(redis_server_url)
        keys = Keys(run_name)
        admission = Admission(client, keys, groups_per_step=2, eta=1)
        granted = [await admission.try_acquire() for _ in range(6)]
        assert granted == [True] * 4 + [False] * 2  # (V + eta + 1) * B = (0 + 1 + 1) * 2
        await client.set(keys.learner_version, 1)
        assert [await admission.try_acquire() for _ in range(3)] == [True, True, False]
        # Many actors at once never overshoot the bound: the check and the increment are atomic.
        await client.set(keys.learner_version, 5)
        results = await asyncio.gather(*[Admission(client, keys, 2, 1).try_acquire() for _ in range(40)])
        assert sum(results) == (5 + 1 + 1) * 2 - 6
        # A learner resuming at version 9 against a Redis that lost the counter: no run-ahead.
        await client.delete(keys.tickets_started)
        await client.set(keys.learner_version, 9)
        assert await floor_started(client, keys, version=9, groups_per_step=2) == 18
        assert await floor_started(client, keys, version=3, groups_per_step=2) == 18  # never lowered
        assert [await admission.try_acquire() for _ in range(5)] == [True] * 4 + [False]  # (9 + 1 + 1) * 2 - 18
        await client.aclose()
    run(scenario())


def test_membership_reports_dead_members(redis_server_url, run_name):
    async def scenario():
        client = connect(redis_server_url)
        members = Membership(client, Keys(run_name))
        await members.heartbeat("a1", host="h", version=3)
        await members.heartbeat("a2", host="h", version=2)
        await asyncio.sleep(0.3)
        await members.heartbeat("a2", host="h", version=4)
        got = {m["id"]: m for m in await members.members(dead_after_s=0.2)}
        assert not got["a1"]["alive"] and got["a2"]["alive"] and got["a2"]["version"] == 4
        await members.leave("a1")
        assert [m["id"] for m in await members.members(dead_after_s=10)] == ["a2"]
        await client.aclose()
    run(scenario())


def test_weight_store_publishes_verifies_and_keeps_the_last_k(redis_server_url, run_name):
    async def scenario():
        client = connect(redis_server_url)
        keys = Keys(run_name)
        store = WeightStore(client, keys, keep=2)
        assert await store.latest() is None
        pubsub = client.pubsub()
        await pubsub.subscribe(keys.weights_channel)
        await pubsub.get_message(timeout=1)  # subscribe confirmation
        for v in range(4):
            await store.publish(v, step=10 * v, blob=bytes([v]) * 100)
        record = await store.latest()
        assert record["version"] == 3 and record["step"] == 30 and record["nbytes"] == 100
        assert await store.fetch(record) == bytes([3]) * 100
        msg = await pubsub.get_message(timeout=1)
        assert msg["data"] == b"0"
        with pytest.raises(WeightVersionError, match="no longer stored"):
            await store.fetch({**record, "version": 1})
        await client.set(keys.weights_blob(3), b"tampered")
        with pytest.raises(WeightVersionError, match="checksum"):
            await store.fetch(record)
        await pubsub.aclose()
        await client.aclose()
    run(scenario())


def test_every_key_of_a_run_shares_its_hash_tag():
    keys = Keys("r1")
    for key in (keys.rollouts(), keys.dead_letters, keys.weights_latest, keys.weights_channel, keys.weights_blob(3),
                keys.learner_version, keys.tickets_started, keys.members, keys.learner_state):
        assert "{r1}" in key
    sharded = Keys("r1", shards=3)
    assert sharded.streams == ["omrl:{r1:q0}:rollouts", "omrl:{r1:q1}:rollouts", "omrl:{r1:q2}:rollouts"]
