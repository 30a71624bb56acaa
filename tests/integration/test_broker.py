"""The rollouts streams, recovery and the weight store on real Redis servers (6.2 and 7)."""

import asyncio
import os
import random

import pytest
import redis.exceptions

from broker.connection import connect
from broker.keys import Keys
from broker.membership import Membership
from broker.retry import RetryPolicy
from broker.status import run_status
from broker.streams import RolloutConsumer, RolloutProducer, stream_info
from broker.weights import STAGING, WeightStore, WeightVersionError

pytestmark = pytest.mark.redis


class Setup:
    """A client, a producer with its flusher running, and consumer c1 of the learner group."""

    def __init__(self, url, run_name, max_len=100, shards=1):
        self.client = connect(url)
        self.keys = Keys(run_name, shards)
        self.producer = RolloutProducer(self.client, self.keys, max_len, retry=RetryPolicy(attempts=3))
        self.consumer = RolloutConsumer(self.client, self.keys, "c1", max_len=max_len)

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
            assert [e.id for e in got] == ids and [e.data for e in got] == [b"group-0", b"group-1", b"group-2"]
            assert [e.deliveries for e in got] == [1, 1, 1]
            assert await s.consumer.read(10, block_ms=100) == []  # nothing new
            await s.consumer.ack(ids[:2])
            assert await s.client.xlen(s.keys.rollouts()) == 1  # acked entries are deleted, the unacked stays
            info = await stream_info(s.client, s.keys, 0)
            assert (info["length"], info["pending"], info["lag"]) == (1, 1, 0)
            assert await s.client.llen(s.keys.space_doorbell()) == 100 - 1  # rung for the room: max_len less 1
    run(scenario())


def test_an_ack_of_thousands_of_entries_goes_through(redis_server_url, run_name):
    """Acks go in scripts of a thousand ids: one script's unpack() of 2,500 ids would pass Lua's stack limit."""
    async def scenario():
        async with Setup(redis_server_url, run_name, max_len=10_000) as s:
            async with s.client.pipeline(transaction=False) as pipe:
                for i in range(2500):
                    pipe.xadd(s.keys.rollouts(), {b"g": b"%d" % i})
                await pipe.execute()
            got = []
            while len(got) < 2500:
                got += await s.consumer.read(1000, block_ms=100)
            await s.consumer.ack([e.id for e in got])
            assert await s.client.xlen(s.keys.rollouts()) == 0
            assert await s.client.llen(s.keys.space_doorbell()) == 256  # a ring pushes at most RING_MAX tokens
    run(scenario())


def test_restarted_consumer_reads_its_pending_entries_once_then_new_ones(redis_server_url, run_name):
    """Five pending entries read two at a time: a pending count that is not a multiple of
    the read count must not trap the reader in its pending list."""
    async def scenario():
        async with Setup(redis_server_url, run_name) as s:
            first = await s.push(*[b"p%d" % i for i in range(5)])
            assert len(await s.consumer.read(10, block_ms=100)) == 5  # delivered, then the consumer "dies"
            later = await s.push(b"new")
            restarted = RolloutConsumer(s.client, s.keys, "c1")
            reads = [await restarted.read(2, block_ms=100) for _ in range(4)]
            assert [[e.id for e in r] for r in reads] == [first[:2], first[2:4], first[4:], later]
            assert [e.deliveries for r in reads for e in r] == [2, 2, 2, 2, 2, 1]  # one re-read each
            assert await restarted.read(2, block_ms=100) == []  # nothing is read twice
            restarted.rewind()  # nothing acknowledged yet: all six are pending again from the start
            assert [e.id for e in await restarted.read(10, block_ms=100)] == first + later
    run(scenario())


def test_janitor_leaves_entries_the_consumer_holds_and_claims_ones_it_never_saw(redis_server_url, run_name):
    """Entries the learner holds (waiting for a checkpoint) are never claimed, however long
    they wait: claiming would bump their delivery count towards the dead letters. Own
    entries it does not hold (a read whose reply was lost) are claimed once they idle."""
    async def scenario():
        async with Setup(redis_server_url, run_name) as s:
            ids = await s.push(b"a", b"b", b"c")
            await s.consumer.read(10, block_ms=100)  # the cursor ends; all three delivered
            assert await s.consumer.read(10, block_ms=100) == []
            await asyncio.sleep(0.3)
            for _ in range(3):
                assert await s.consumer.claim_idle(min_idle_ms=100, held=set(ids)) == []
            [lost] = await s.consumer.claim_idle(min_idle_ms=100, held={ids[0], ids[2]})
            assert lost == (ids[1], b"b", 2)
            rows = await s.client.xpending_range(s.keys.rollouts(), s.keys.consumer_group, "-", "+", 10)
            assert [r["times_delivered"] for r in rows] == [1, 2, 1]
            fresh = RolloutConsumer(s.client, s.keys, "c1")  # a restarted consumer, cursor still running
            assert await fresh.claim_idle(min_idle_ms=100) == []
    run(scenario())


def test_pending_entry_whose_payload_was_deleted_comes_back_empty(redis_server_url, run_name):
    async def scenario():
        async with Setup(redis_server_url, run_name) as s:
            [entry] = await s.push(b"x")
            await s.consumer.read(10, block_ms=100)
            await s.client.xdel(s.keys.rollouts(), entry)
            restarted = RolloutConsumer(s.client, s.keys, "c1")
            assert [(e.id, e.data) for e in await restarted.read(10, block_ms=100)] == [(entry, None)]
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
            claimed = await janitor.claim_idle(min_idle_ms=100)
            assert claimed == [(ids[0], b"a", 2), (ids[2], b"c", 2)]  # claiming is a delivery
            # The deleted entry is acknowledged on the spot (6.2 claims it as (None, None),
            # 7.x drops it from the pending list): nothing is left pending but the claimed two.
            assert (await stream_info(s.client, s.keys, 0))["pending"] == 2
            await janitor.ack([ids[0], ids[2]])
            assert (await stream_info(s.client, s.keys, 0))["pending"] == 0
            assert await janitor.remove_gone_consumers(idle_ms=100) == ["dead"]  # idle, holding nothing
            names = {c["name"] for c in await s.client.xinfo_consumers(s.keys.rollouts(), s.keys.consumer_group)}
            assert b"dead" not in names and b"janitor" in names
    run(scenario())


def test_dead_letter_keeps_payload_and_reason(redis_server_url, run_name):
    async def scenario():
        async with Setup(redis_server_url, run_name) as s:
            [entry] = await s.push(b"\xff garbage")
            [(got, data, _)] = await s.consumer.read(10, block_ms=100)
            await s.consumer.dead_letter(got, data, "undecodable", "not a msgpack message")
            [(_, fields)] = await s.client.xrange(s.keys.dead_letters)
            assert fields[b"reason"] == b"undecodable" and fields[b"data"] == b"\xff garbage"
            assert fields[b"entry"] == entry.encode() and fields[b"stream"] == s.keys.rollouts().encode()
            assert await s.client.xlen(s.keys.rollouts()) == 0
            assert await s.client.hget(s.keys.counts, "dead:undecodable") == b"1"
            # Again (a retry after a lost reply, or after Redis restarted mid-move): moved once.
            await s.consumer.dead_letter(got, data, "undecodable", "not a msgpack message")
            assert await s.client.xlen(s.keys.dead_letters) == 1
            assert await s.client.hget(s.keys.counts, "dead:undecodable") == b"1"
            assert await s.client.get(s.keys.tickets_accepted) == b"-1"  # its ticket came back once
    run(scenario())


def test_a_filtered_entry_is_counted_and_its_ticket_given_back_but_not_kept(redis_server_url, run_name):
    """learner.filter_groups: a group without signal leaves the stream as a dead letter does
    (acknowledged, deleted, its ticket back), counted as filtered, and no dead letter holds it;
    the books add up with it."""
    from broker.status import format_accounting

    async def scenario():
        async with Setup(redis_server_url, run_name) as s:
            await s.client.hset(s.keys.counts, mapping={"started": 3, "produced": 3})
            await s.client.set(s.keys.tickets_accepted, 3)
            await s.push(b"a", b"b", b"c")
            got = [e for e, _, _ in await s.consumer.read(10, block_ms=100)]
            for _ in range(2):  # again: a retry after a lost reply counts it once
                await s.consumer.filter(got[0], "no_signal")
                await s.consumer.filter(got[1], "no_signal")
            assert await s.client.xlen(s.keys.dead_letters) == 0 and await s.client.xlen(s.keys.rollouts()) == 1
            assert await s.client.get(s.keys.tickets_accepted) == b"1"
            status = await run_status(s.client, s.keys, dead_after_s=10)
            groups = status["groups"]
            assert groups["filtered"] == {"no_signal": 2} and groups["dead_lettered"] == {}
            assert groups["waiting"] == 1 and groups["unaccounted"] == 0, groups
            assert "2 filtered (no_signal 2) + 1 waiting" in format_accounting(groups)
    run(scenario())


def test_dead_letter_stream_is_capped_and_its_counts_kept_whole(redis_server_url, run_name):
    async def scenario():
        async with Setup(redis_server_url, run_name, max_len=1000) as s:
            ids = await s.push(*[b"x%d" % i for i in range(300)])
            await s.consumer.read(300, block_ms=100)
            for i, entry_id in enumerate(ids):
                await s.consumer.dead_letter(entry_id, b"x", "invalid" if i % 3 else "stale", max_len=20)
            # MAXLEN ~ trims whole radix-tree nodes (100 entries): about 20, never 300.
            assert 20 <= await s.client.xlen(s.keys.dead_letters) <= 120
            status = await run_status(s.client, s.keys, dead_after_s=10)
            assert status["groups"]["dead_lettered"] == {"invalid": 200, "stale": 100}
    run(scenario())


def test_status_shows_the_evaluator_and_the_newest_evaluation(redis_server_url, run_name):
    from broker.evals import finish_eval
    from broker.membership import Membership
    from broker.status import format_status

    async def scenario():
        async with Setup(redis_server_url, run_name) as s:
            assert format_status(await run_status(s.client, s.keys, 10)).endswith("evaluation: none yet")
            members = Membership(s.client, s.keys)
            await members.heartbeat("h-evaluator", role="evaluator", version=40, evaluations=2)
            await members.heartbeat("h-0", role="actor", index=0, version=41, groups=9)
            for version, success in ((0, 0.25), (40, 0.75)):
                await finish_eval(s.client, s.keys, version // 40, "h-evaluator", {
                    "version": version, "last_version": version, "episodes": 16, "success": success,
                    "success_ci": [success - 0.2, success + 0.1], "reward": success,
                    "reward_ci": [success - 0.1, success + 0.1]})
            status = await run_status(s.client, s.keys, dead_after_s=10)
            assert status["evaluation"]["version"] == 40
            text = format_status(status)
            assert "actors: 1 live, 0 dead" in text and "evaluator h-evaluator: live, version 40, 2 evaluations" in text
            assert text.endswith("evaluation: version 40, success 0.750 [0.550, 0.850], reward 0.750 [0.650, 0.850], "
                                 "16 held-out episodes")
    run(scenario())


def test_producer_waits_while_the_stream_is_full(redis_server_url, run_name):
    async def scenario():
        async with Setup(redis_server_url, run_name, max_len=2) as s:
            await s.push(b"1", b"2")
            await s.producer.push(b"3")
            await asyncio.sleep(0.3)
            assert s.producer.buffered == 0 and await s.client.xlen(s.keys.rollouts()) == 2  # waits, trims nothing
            got = await s.consumer.read(2, block_ms=100)
            await s.consumer.ack([e.id for e in got])
            await asyncio.wait_for(s.producer.flush(), 5)
            assert [e.data for e in await s.consumer.read(10, block_ms=100)] == [b"3"]
    run(scenario())


def test_many_producers_never_push_the_stream_past_its_bound(redis_server_url, run_name):
    """16 producers on their own connections, each with groups to send, a stream bounded at
    5 and a slow reader: the length never goes past 5 (a length check apart from the XADD
    lets producers that checked at the same time all add). The producers wait on the stream's
    doorbell with a fallback longer than the whole test: only the reader's acks wake them."""
    async def scenario():
        keys = Keys(run_name)
        clients = [connect(redis_server_url) for _ in range(17)]
        producers = [RolloutProducer(c, keys, 5, fallback_s=25) for c in clients[:16]]
        consumer = RolloutConsumer(clients[16], keys, "c1", max_len=5)
        await consumer.ensure_group()
        flushers = [asyncio.create_task(p.run()) for p in producers]
        for i, p in enumerate(producers):
            for j in range(4):
                await p.push(b"%d-%d" % (i, j))
        while await clients[16].xlen(keys.rollouts()) < 5:  # the bound reached before the reader starts
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # time to overshoot, were the length check and the XADD apart
        lengths, got = [], []
        while len(got) < 64:
            lengths.append(await clients[16].xlen(keys.rollouts()))
            entries = await consumer.read(3, block_ms=100)
            await consumer.ack([e.id for e in entries])
            got += [e.data for e in entries]
        for task in flushers:
            task.cancel()
        for c in clients:
            await c.aclose()
        return lengths, got

    lengths, got = run(asyncio.wait_for(scenario(), 20))
    assert lengths[0] == 5 and max(lengths) == 5  # at the bound, never past it
    assert sorted(got) == sorted(b"%d-%d" % (i, j) for i in range(16) for j in range(4))


def test_membership_reports_dead_members(redis_server_url, run_name):
    async def scenario():
        client = connect(redis_server_url)
        members = Membership(client, Keys(run_name))
        await members.heartbeat("a1", host="h", version=3)
        await members.heartbeat("a2", host="h", version=2)
        await members.heartbeat("a3", host="h", state="starting", quiet_s=60)  # its engine's start is long
        await asyncio.sleep(1.5)  # margins a loaded machine keeps: a1 1.5 s silent, a2 read within 1 s of its beat
        await members.heartbeat("a2", host="h", version=4)
        got = {m["id"]: m for m in await members.members(dead_after_s=1.0)}
        assert not got["a1"]["alive"] and got["a2"]["alive"] and got["a2"]["version"] == 4
        assert got["a3"]["alive"] and got["a3"]["state"] == "starting"
        await members.leave("a3")
        await members.leave("a1")
        assert [m["id"] for m in await members.members(dead_after_s=10)] == ["a2"]
        await client.aclose()
    run(scenario())


def test_actor_slots_are_distinct_kept_across_restarts_and_reused(redis_server_url, run_name):
    """Replicas with no index of their own (a scaled compose service) get distinct indexes;
    a restarted replica gets its own back with its start count; a clean leave frees the
    index for the next newcomer; a silent holder's slot goes stale; concurrent claims never
    share an index."""
    async def scenario():
        client = connect(redis_server_url)
        members = Membership(client, Keys(run_name))
        assert [await members.claim_slot(n) for n in ("c1", "c2", "c3")] == [(0, 0), (1, 0), (2, 0)]
        assert await members.claim_slot("c2") == (1, 1)  # restarted: same index, second start
        assert await members.claim_slot("c2") == (1, 2)
        await members.leave("c1")  # scaled down: index 0 is free again
        assert await members.claim_slot("c4") == (0, 0)
        assert await members.claim_slot("host-7", given=7) == (7, 0)  # `--index 7` keeps its index
        assert await members.claim_slot("c5") == (3, 0)
        assert await members.slots() == {"c2": 1, "c3": 2, "c4": 0, "host-7": 7, "c5": 3}
        # c3 goes silent (killed, never restarted) while the others renew: past the stale age
        # its index is the lowest free one.
        await asyncio.sleep(0.3)
        for name in ("c2", "c4", "host-7", "c5"):
            assert await members.renew_slot(name)
        assert not await members.renew_slot("gone")
        assert await members.claim_slot("c6", stale_s=0.2) == (2, 0)
        assert set(await members.slots()) == {"c2", "c4", "host-7", "c5", "c6"}
        many = await asyncio.gather(*(members.claim_slot(f"r{i}") for i in range(20)))
        assert sorted(index for index, _ in many) == [4, 5, 6, *range(8, 25)]
        await client.aclose()
    run(scenario())


def test_weight_store_publishes_verifies_and_keeps_the_last_k(redis_server_url, run_name, tmp_path):
    """Blob versions in Redis chunks (100 bytes in chunks of 32: 4 chunks) and in a shared
    directory: fetched whole and verified, the last `keep` kept, the rest deleted."""
    async def scenario():
        client = connect(redis_server_url)
        keys = Keys(run_name)
        store = WeightStore(client, keys, keep=2, chunk_bytes=32)
        assert await store.latest() is None
        pubsub = client.pubsub()
        await pubsub.subscribe(keys.weights_channel)
        await pubsub.get_message(timeout=1)  # subscribe confirmation
        for v in range(4):
            await store.publish(v, step=10 * v, blob=bytes(range(v, v + 100)))
        record = await store.latest()
        assert record["version"] == 3 and record["step"] == 30 and record["nbytes"] == 100
        assert record["transport"] == "redis" and record["chunks"] == 4
        assert await store.fetch(record) == bytes(range(3, 103))
        assert await store.fetch(await store.latest(2)) == bytes(range(2, 102))
        msg = await pubsub.get_message(timeout=1)
        assert msg["data"] == b"0"
        assert await store.latest(1) is None and not await client.exists(keys.weights_chunk(1, 0))
        assert [int(v) for v in await client.zrange(keys.weights_kept, 0, -1)] == [2, 3]
        with pytest.raises(WeightVersionError, match="no longer stored"):
            await store.fetch({**record, "version": 1})
        await client.set(keys.weights_chunk(3, 2), b"tampered")
        with pytest.raises(WeightVersionError, match="checksum"):
            await store.fetch(record)

        shared = WeightStore(client, keys, keep=2, directory=str(tmp_path / "shared"))
        for v in (4, 5, 6):
            await shared.publish(v, step=v, blob=b"v%d" % v)
        record = await shared.latest()
        assert record["transport"] == "dir" and record["path"] == str(tmp_path / "shared" / "v6.safetensors")
        assert await shared.fetch(record) == b"v6"
        # A receiver holds its own link while it loads: the rotation does not pull the bytes away.
        pinned = await shared.fetch_to(await shared.latest(5), str(tmp_path))
        assert pinned.startswith(str(tmp_path / "shared" / "readers")) and not os.path.samefile(pinned, record["path"])
        await shared.publish(8, step=8, blob=b"v8")  # keep 2: version 5 rotates out mid-load
        assert not (tmp_path / "shared" / "v5.safetensors").exists() and open(pinned, "rb").read() == b"v5"
        os.unlink(pinned)
        assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["readers", "v6.safetensors", "v8.safetensors"]
        assert not list((tmp_path / "shared" / "readers").iterdir())
        assert not await client.exists(keys.weights_chunk(3, 0))  # version 3's chunks went with it
        (tmp_path / "shared" / "v6.safetensors").write_bytes(b"v7")
        with pytest.raises(WeightVersionError, match="checksum"):
            await shared.fetch(record)
        assert not list((tmp_path / "shared" / "readers").iterdir())  # the failed reader's link is gone
        # Redis restarted empty (no AOF): the files it no longer knows of still go.
        await client.delete(keys.weights_kept)
        await shared.publish(9, step=9, blob=b"v9")
        assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["readers", "v9.safetensors"]
        await pubsub.aclose()
        await client.aclose()
    run(scenario())


def test_weights_over_the_servers_value_limit_go_in_chunks_under_it(redis_server_url, run_name):
    """Redis drops the connection on a value over proto-max-bulk-len (here lowered to 1 MiB,
    its smallest), which looks like a network fault: the store's chunks stay under it."""
    async def scenario():
        client = connect(redis_server_url)
        (old,) = (await client.config_get("proto-max-bulk-len")).values()
        await client.config_set("proto-max-bulk-len", 1 << 20)
        try:
            store = WeightStore(client, Keys(run_name))
            raw = connect(redis_server_url)  # what a plain SET gets: the connection dropped or a protocol error
            with pytest.raises((redis.exceptions.ConnectionError, redis.exceptions.ResponseError)):
                await raw.set("too-large", b"x" * (2 << 20))
            await raw.aclose()
            blob = os.urandom(5 << 19)  # 2.5 MiB
            await store.publish(1, 1, blob)
            record = await store.latest()
            assert record["chunks"] == 3 and record["nbytes"] == len(blob)
            assert await store.fetch(record) == blob
        finally:
            await client.config_set("proto-max-bulk-len", old)
            await client.aclose()
    run(scenario())


def test_a_version_published_from_a_file_is_taken_whole(redis_server_url, run_name, tmp_path):
    """What the learner publishes: a file (written as the weights are gathered), read into Redis a
    chunk at a time, or linked into weights.dir; the file is taken once the record is out (a
    Redis fault before that leaves it for the retry), and the version reads back byte for byte."""
    async def scenario():
        client = connect(redis_server_url)
        data = os.urandom(1000)
        for store in (WeightStore(client, Keys(run_name), chunk_bytes=300),
                      WeightStore(client, Keys(run_name + "-dir"), directory=str(tmp_path / "shared"))):
            staged = tmp_path / STAGING
            staged.write_bytes(data)
            announce, faults = store.announce, [redis.exceptions.ConnectionError("connection lost")]

            async def flaky(record):  # the first announcement is lost, as in a Redis restart
                if faults:
                    raise faults.pop()
                return await announce(record)

            store.announce = flaky
            with pytest.raises(redis.exceptions.ConnectionError):
                await store.publish(1, 1, str(staged))
            assert staged.exists()  # what the bridge's retry calls publish again with
            record = await store.publish(1, 1, str(staged))
            assert not staged.exists() and record["nbytes"] == 1000
            assert record["chunks"] == 4 if record["transport"] == "redis" else record["path"].endswith("v1.safetensors")
            assert await store.fetch(record) == data
        await client.aclose()
    run(scenario())


def test_every_key_of_a_run_shares_its_hash_tag():
    keys = Keys("r1")
    for key in (keys.rollouts(), keys.dead_letters, keys.weights_latest, keys.weights_channel, keys.weights_chunk(3, 0),
                keys.weights_record(3), keys.weights_kept,
                keys.tickets_held, keys.tickets_lost, keys.tickets_accepted, keys.tickets_doorbell, keys.counts,
                keys.members, keys.learner_state):
        assert "{r1}" in key
    sharded = Keys("r1", shards=3)
    assert sharded.streams == ["omrl:{r1:q0}:rollouts", "omrl:{r1:q1}:rollouts", "omrl:{r1:q2}:rollouts"]
    assert sharded.space_doorbell(2) == "omrl:{r1:q2}:rollouts:doorbell"  # the stream's slot: one script rings it


def test_a_stopping_producer_writes_its_buffer_past_the_length_bound(redis_server_url, run_name):
    """Clean stops lose nothing: an actor that stops while the learner is gone (the stream
    full) still writes the groups it finished; the bound is back-pressure, not a cap."""
    async def scenario():
        async with Setup(redis_server_url, run_name, max_len=2) as s:
            await s.push(b"1", b"2")
            for p in (b"3", b"4"):
                await s.producer.push(p)
            await asyncio.sleep(0.2)
            assert await s.client.xlen(s.keys.rollouts()) == 2  # waiting on the bound
            s.producer.unbounded.set()  # wakes the producer waiting on the doorbell
            await asyncio.wait_for(s.producer.flush(), 5)
            assert await s.client.xlen(s.keys.rollouts()) == 4
    run(scenario())


def test_a_cancelled_call_is_cancelled_and_the_connection_stays_in_step(redis_server_url, run_name):
    """A task cancelled at a random moment of a Redis call must end cancelled, never with the
    call's result (Python 3.11's wait_for, under which redis-py sends, drops a cancellation
    that meets the send's end: broker.connection.cancel_safe), and the next call on the
    client must get its own reply, not the cancelled one's."""
    rng = random.Random()
    key = f"{{{run_name}}}:n"

    async def scenario():
        client = connect(redis_server_url)
        script = client.register_script("return redis.call('GET', KEYS[1])")
        ran_on, cancelled = 0, 0
        for i in range(600):
            call = [lambda: client.get(key), client.ping, lambda: script(keys=[key])][i % 3]
            task = asyncio.ensure_future(call())
            for _ in range(rng.randrange(6)):  # the cancellation lands after 0-5 turns of the loop
                await asyncio.sleep(0)
            if task.cancel():
                try:
                    await task
                    ran_on += 1
                except asyncio.CancelledError:
                    cancelled += 1
            await client.set(key, i)
            assert await client.get(key) == str(i).encode()
        await client.aclose()
        return ran_on, cancelled

    ran_on, cancelled = run(scenario())
    print(f"{cancelled} calls cancelled, {ran_on} ran on")
    assert ran_on == 0, f"{ran_on} of {ran_on + cancelled} cancelled calls ran on"
    assert cancelled >= 20, "too few calls were still running when cancelled to test anything"
