"""The rollouts stream and the weight store on a real Redis server."""

import asyncio

import pytest

from broker.keys import Keys
from broker.streams import RolloutConsumer, RolloutProducer, connect
from broker.weights import WeightStore, WeightVersionError

pytestmark = pytest.mark.redis


def run(coro):
    return asyncio.run(coro)


async def _setup(url, run_name, max_len=100):
    client = connect(url, blocking=True)
    keys = Keys(run_name)
    consumer = RolloutConsumer(client, keys, "c1")
    await consumer.ensure_group()
    await consumer.ensure_group()  # idempotent
    return client, keys, RolloutProducer(client, keys, max_len), consumer


def test_delivery_then_ack_deletes(redis_server_url, run_name):
    async def scenario():
        client, keys, producer, consumer = await _setup(redis_server_url, run_name)
        ids = [await producer.push(f"group-{i}".encode()) for i in range(3)]
        got = await consumer.read(10, block_ms=100)
        assert [e for e, _ in got] == ids and [d for _, d in got] == [b"group-0", b"group-1", b"group-2"]
        assert await consumer.read(10, block_ms=100) == []  # nothing new
        await consumer.ack(ids[:2])
        assert await client.xlen(keys.rollouts) == 1  # acked entries are deleted, the unacked stays
        pending = await client.xpending(keys.rollouts, keys.consumer_group)
        assert pending["pending"] == 1
        await client.aclose()
    run(scenario())


def test_restarted_consumer_rereads_its_pending_entries_first(redis_server_url, run_name):
    async def scenario():
        client, keys, producer, consumer = await _setup(redis_server_url, run_name)
        first = [await producer.push(b"a"), await producer.push(b"b")]
        assert len(await consumer.read(10, block_ms=100)) == 2  # delivered, then the consumer "dies"
        later = await producer.push(b"c")
        restarted = RolloutConsumer(client, keys, "c1")
        assert [e for e, _ in await restarted.read(10, block_ms=100)] == first
        await restarted.ack(first)
        assert [e for e, _ in await restarted.read(10, block_ms=100)] == [later]
        await client.aclose()
    run(scenario())


def test_pending_entry_whose_payload_was_deleted_comes_back_empty(redis_server_url, run_name):
    async def scenario():
        client, keys, producer, consumer = await _setup(redis_server_url, run_name)
        entry = await producer.push(b"x")
        await consumer.read(10, block_ms=100)
        await client.xdel(keys.rollouts, entry)
        restarted = RolloutConsumer(client, keys, "c1")
        assert await restarted.read(10, block_ms=100) == [(entry, None)]
        await client.aclose()
    run(scenario())


def test_dead_letter_keeps_payload_and_reason(redis_server_url, run_name):
    async def scenario():
        client, keys, producer, consumer = await _setup(redis_server_url, run_name)
        entry = await producer.push(b"\xff garbage")
        [(got, data)] = await consumer.read(10, block_ms=100)
        await consumer.dead_letter(got, data, "invalid", "not a msgpack message")
        [(_, fields)] = await client.xrange(keys.dead_letters)
        assert fields[b"reason"] == b"invalid" and fields[b"data"] == b"\xff garbage" and fields[b"entry"] == entry.encode()
        assert await client.xlen(keys.rollouts) == 0
        await client.aclose()
    run(scenario())


def test_producer_waits_while_the_stream_is_full(redis_server_url, run_name):
    async def scenario():
        client, keys, producer, consumer = await _setup(redis_server_url, run_name, max_len=2)
        await producer.push(b"1")
        await producer.push(b"2")
        blocked = asyncio.create_task(producer.push(b"3"))
        await asyncio.sleep(0.3)
        assert not blocked.done() and await client.xlen(keys.rollouts) == 2  # waits, trims nothing
        got = await consumer.read(2, block_ms=100)
        await consumer.ack([e for e, _ in got])
        await asyncio.wait_for(blocked, 5)
        assert [d for _, d in await consumer.read(10, block_ms=100)] == [b"3"]
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
    for key in (keys.rollouts, keys.dead_letters, keys.weights_latest, keys.weights_channel, keys.weights_blob(3)):
        assert "{r1}" in key
