"""Admission tickets on real Redis servers (6.2 and 7): the staleness bound counts optimizer
steps whatever publish_every is, and no ticket is ever leaked: failed, cancelled and
dead actors' tickets come back, each counted, and the books balance."""

import asyncio
import itertools
import random
import time

import pytest

from broker.admission import Admission, group_counts, wake_waiting
from broker.connection import connect
from broker.keys import Keys
from broker.retry import RetryPolicy
from broker.streams import RolloutConsumer, RolloutProducer
from broker.weights import WeightStore

pytestmark = pytest.mark.redis


def run(coro):
    return asyncio.run(coro)


async def publish(client, keys: Keys, version: int, step: int) -> None:
    await WeightStore(client, keys).publish(version, step, b"w")


def balanced(counts: dict) -> bool:
    return counts["started"] == counts["produced"] + sum(counts["failed"].values()) + counts["held"]


@pytest.mark.parametrize("publish_every", [1, 2, 3])
def test_bound_counts_optimizer_steps_whatever_publish_every_is(redis_server_url, run_name, publish_every):
    B, eta, k = 2, 2, publish_every  # eta >= k - 1, as the config requires

    async def scenario():
        client = connect(redis_server_url)
        keys = Keys(run_name)
        admission = Admission(client, keys, groups_per_step=B, eta=eta)
        slack = (eta + 1) * B  # eta steps ahead of the newest weights' step, not eta versions
        granted = [await admission.try_acquire(f"a|1|{i}") for i in range(slack + 2)]
        assert granted == [True] * slack + [False] * 2
        for i in range(slack):
            await admission.commit(f"a|1|{i}")  # in the stream now: still counted
        assert not await admission.try_acquire("a|1|x")
        await publish(client, keys, 1, k)  # version 1 at step k: k * B more
        assert [await admission.try_acquire(f"a|2|{i}") for i in range(k * B + 1)] == [True] * (k * B) + [False]
        # Many actors at once never overshoot: check and grant are one script.
        await publish(client, keys, 4, 4 * k)
        results = await asyncio.gather(*[admission.try_acquire(f"b|1|{i}") for i in range(40)])
        assert sum(results) == 3 * k * B  # step 4k: 3k steps' worth more
        counts = await group_counts(client, keys)
        assert counts["started"] == slack + k * B + 3 * k * B and balanced(counts)
        await client.aclose()
    run(scenario())


def test_every_ticket_ends_once_and_the_books_balance(redis_server_url, run_name):
    async def scenario():
        client = connect(redis_server_url)
        keys = Keys(run_name)
        admission = Admission(client, keys, groups_per_step=4, eta=1, ticket_ttl_s=0.3)
        tickets = [f"host-0|p1|{i}" for i in range(8)]
        assert all([await admission.try_acquire(t) for t in tickets])
        assert await admission.try_acquire(tickets[0])  # a retried request whose reply was lost: same ticket
        assert not await admission.try_acquire("host-0|p1|extra")  # the bound: 8 held
        assert await admission.commit(tickets[0]) == 1
        assert await admission.commit(tickets[0]) == 0  # a retried commit counts nothing twice
        assert await admission.release(tickets[1], "env_error")
        assert not await admission.release(tickets[1], "env_error")
        assert await admission.try_acquire("host-0|p1|8")  # the failed group's ticket came back
        counts = await group_counts(client, keys)
        assert (counts["started"], counts["produced"], counts["failed"], counts["held"]) == (9, 1, {"env_error": 1}, 7)

        # The actor dies: no renewals. Its tickets expire and come back as actor_lost...
        for _ in range(3):
            await asyncio.sleep(0.15)
            await admission.renew(tickets[2:4])  # ...except the two a live actor keeps renewing
        assert await admission.try_acquire("host-1|p1|0")  # purges the expired ones
        counts = await group_counts(client, keys)
        assert counts["failed"] == {"actor_lost": 5, "env_error": 1} and counts["held"] == 3 and balanced(counts)
        # A group whose ticket came back is written after all: produced, and no longer lost.
        assert await admission.commit(tickets[4]) == 2
        counts = await group_counts(client, keys)
        assert counts["failed"]["actor_lost"] == 4 and counts["produced"] == 2 and balanced(counts)
        await client.aclose()
    run(scenario())


def test_a_renewal_of_thousands_of_tickets_renews_only_those_held(redis_server_url, run_name):
    async def scenario():
        client = connect(redis_server_url)
        keys = Keys(run_name)
        admission = Admission(client, keys, groups_per_step=8, eta=1, ticket_ttl_s=100.0)
        held = [f"a|1|{i}" for i in range(3)]
        assert all([await admission.try_acquire(t) for t in held])
        before = {t: await client.zscore(keys.tickets_held, t) for t in held}
        await asyncio.sleep(0.05)
        await admission.renew(sorted([*held, *[f"a|1|w{i}" for i in range(2500)]]))  # in slices of a thousand
        assert await client.zcard(keys.tickets_held) == 3  # XX: a ticket not held is not added
        assert all([await client.zscore(keys.tickets_held, t) > before[t] for t in held])
        await client.aclose()
    run(scenario())


def test_a_restarted_actor_returns_its_predecessors_tickets(redis_server_url, run_name):
    async def scenario():
        client = connect(redis_server_url)
        keys = Keys(run_name)
        admission = Admission(client, keys, groups_per_step=8, eta=1)
        for t in ("host-1|old|0", "host-1|old|1", "host-1|new|0", "host-10|old|0", "host-2|old|0"):
            assert await admission.try_acquire(t)
        assert await admission.release_predecessors("host-1", "new") == 2  # not host-10's, not its own
        counts = await group_counts(client, keys)
        assert counts["failed"] == {"actor_lost": 2} and counts["held"] == 3 and balanced(counts)
        await client.aclose()
    run(scenario())


def test_floor_and_dead_letters_keep_the_bound_honest(redis_server_url, run_name):
    async def scenario():
        client = connect(redis_server_url)
        keys = Keys(run_name)
        admission = Admission(client, keys, groups_per_step=2, eta=0)
        await publish(client, keys, 9, 9)
        # A Redis that lost the counter: the learner's floor (groups it trained on) restores it.
        assert await wake_waiting(client, keys, groups_per_step=2, eta=0, trained_groups=18) == 18
        assert await client.llen(keys.tickets_doorbell) == 2  # rung for the 2 groups the bound lets in
        assert await wake_waiting(client, keys, groups_per_step=2, eta=0, trained_groups=6) == 18  # never lowered
        assert [await admission.try_acquire(f"a|1|{i}") for i in range(3)] == [True, True, False]
        assert await client.llen(keys.tickets_doorbell) == 0  # the refusal emptied it
        # A dead-lettered group gives its ticket back.
        consumer = RolloutConsumer(client, keys, "learner-0")
        await consumer.ensure_group()
        entry = await client.xadd(keys.rollouts(), {b"g": b"garbage"})
        await consumer.read(1, block_ms=100)
        await consumer.dead_letter(entry.decode(), b"garbage", "undecodable")
        assert await admission.try_acquire("a|1|3")
        await client.aclose()
    run(scenario())


def test_waiting_groups_are_woken_by_what_lets_them_in_not_by_polling(redis_server_url, run_name):
    """Groups refused a ticket wait on the doorbell with a fallback of 20 s: a publication
    wakes as many as the new bound lets in, within a fraction of the fallback, and no more;
    a released ticket wakes one more; a stop ends a wait at once. Counted from Redis's own
    command statistics: the waiters sent no script call while they waited."""
    B, fallback = 2, 20.0

    async def scenario():
        client = connect(redis_server_url)
        keys = Keys(run_name)
        admission = Admission(client, keys, groups_per_step=B, eta=0, fallback_s=fallback)
        await publish(client, keys, 0, 0)
        assert [await admission.try_acquire(f"a|1|{i}") for i in range(B + 1)] == [True] * B + [False]
        stop = asyncio.Event()
        granted: list[float] = []

        async def group(i: int) -> bool:
            got = await admission.acquire(f"w|1|{i}", stop)
            granted.append(time.monotonic())
            return got

        waiters = [asyncio.create_task(group(i)) for i in range(5)]
        await asyncio.sleep(0.5)
        calls = await script_calls(client)
        await asyncio.sleep(1.0)
        assert await script_calls(client) - calls <= 1 and not granted  # asleep: nothing polls
        started = time.monotonic()
        await publish(client, keys, 1, 1)
        await wake_waiting(client, keys, B, eta=0)  # one step more: B groups more
        while len(granted) < B:
            await asyncio.sleep(0.01)
        woken_s = time.monotonic() - started
        await asyncio.sleep(0.5)
        assert len(granted) == B  # no herd: the others sleep on
        assert await admission.release("a|1|0", "env_error")  # one ticket back: one more group
        while len(granted) < B + 1:
            await asyncio.sleep(0.01)
        assert time.monotonic() - started < fallback / 10
        stop.set()
        results = await asyncio.wait_for(asyncio.gather(*waiters), fallback / 10)
        assert sorted(results) == [False, False, True, True, True]
        assert (admission.doorbell.rung, admission.doorbell.timed_out) == (B + 1, 0)  # a token a group let in
        await client.aclose()
        return woken_s

    assert run(scenario()) < fallback / 20


def test_the_learners_janitor_wakes_groups_that_expired_tickets_let_in(redis_server_url, run_name):
    """An actor dies holding every ticket the bound allows: nothing rings when its tickets
    expire, but the learner's janitor rings the doorbell every round for the room there is
    (expired tickets count as room), so a group waiting with a fallback of 20 s gets in
    within a few rounds."""
    from common.config import RedisConfig
    from learner.bridge import BrokerBridge

    B, eta = 2, 0
    cfg = RedisConfig(url=redis_server_url, run=run_name, janitor_every_s=0.2)
    bridge = BrokerBridge(cfg, "learner-0", keep_versions=2, queue_size=4, read_count=2, admission=(B, eta)).start()

    async def scenario():
        client = connect(redis_server_url)
        keys = Keys(run_name)
        await publish(client, keys, 0, 0)
        dying = Admission(client, keys, B, eta, ticket_ttl_s=0.5)
        assert [await dying.try_acquire(f"dead|1|{i}") for i in range(B)] == [True] * B
        waiting = Admission(client, keys, B, eta, fallback_s=20.0)
        started = time.monotonic()
        assert await asyncio.wait_for(waiting.acquire("live|1|0"), 10)
        counts = await group_counts(client, keys)
        await client.aclose()
        return time.monotonic() - started, waiting.doorbell, counts

    try:
        waited, doorbell, counts = run(scenario())
    finally:
        bridge.stop()
    assert 0.5 <= waited < 3 and (doorbell.rung, doorbell.timed_out) == (1, 0)
    assert counts["failed"] == {"actor_lost": B} and balanced(counts)


async def script_calls(client) -> int:
    """EVAL and EVALSHA calls the server has run so far."""
    stats = await client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


@pytest.mark.parametrize("publish_every", [2, 3])
def test_actors_dying_with_tickets_never_stall_the_learner(redis_server_url, run_name, publish_every):
    """Simulated actors (5 group loops each) produce through the real producer, which
    commits each ticket after its XADD; a fifth of the groups fail; three actors die
    holding a ticket in every loop (15 tickets, more than the bound's slack of (eta + 1) B =
    3k + 3, so a leak would stall the run for good). A simulated learner consumes B groups a
    step through the real consumer and publishes every k steps: it must reach its steps, and
    at every step the groups started and not failed must stay within the bound, as counted
    from the outside: started - failed <= S B + (eta + 1) B, S the newest published step."""
    B, k, steps, loops = 3, publish_every, 30, 5
    eta = k  # at least k - 1

    async def scenario():
        client = connect(redis_server_url)
        keys = Keys(run_name)
        store = WeightStore(client, keys)
        await store.publish(0, 0, b"w")
        version = 0
        rng = random.Random(publish_every)

        async def actor(name: str, dies_after: int | None):
            # Only the dying actors' tickets expire soon: a live one's expiring before its commit (a
            # slow machine's flush past 0.5 s) would be room handed out twice, and its late commit
            # would take the count past the bound by that group (broker/admission.py).
            admission = Admission(client, keys, B, eta, ticket_ttl_s=0.5 if dies_after is not None else 60.0)
            producer = RolloutProducer(client, keys, max_len=1000, retry=RetryPolicy(attempts=3), admission=admission)
            tickets = itertools.count()
            dead = asyncio.Event()

            async def group_loop():
                while True:
                    ticket = f"{name}|1|{next(tickets)}"
                    await admission.acquire(ticket)
                    await asyncio.sleep(rng.random() * 0.01)
                    if dies_after is not None and int(ticket.rsplit("|", 1)[1]) >= dies_after:
                        dead.set()
                    if dead.is_set():
                        return  # dies holding the ticket: no commit, no release, no renewal
                    if rng.random() < 0.2:
                        await admission.release(ticket, "env_error")
                    else:
                        await producer.push(b"group", ticket)

            flusher = asyncio.create_task(producer.run())
            try:
                await asyncio.gather(*[group_loop() for _ in range(loops)])
            finally:
                flusher.cancel()

        actors = [asyncio.create_task(actor(f"actor-{i}", dies_after=(8 if i < 3 else None))) for i in range(5)]
        consumer = RolloutConsumer(client, keys, "learner-0")
        await consumer.ensure_group()
        ahead = []  # groups started and not failed, less the bound, at each step
        published_step = 0
        for step in range(1, steps + 1):
            batch = []
            while len(batch) < B:
                got = await consumer.read(B - len(batch), block_ms=200)
                if not got:  # what the learner's janitor does every round: expired tickets are room
                    await wake_waiting(client, keys, B, eta)
                batch += got
            await consumer.ack([e.id for e in batch])
            counts = await group_counts(client, keys)
            ahead.append(counts["started"] - sum(counts["failed"].values()) - (published_step * B + (eta + 1) * B))
            if step % k == 0:
                version += 1
                published_step = step
                await store.publish(version, step, b"w")
                await wake_waiting(client, keys, B, eta, trained_groups=step * B)  # as the learner does: wakes the waiters
        for a in actors:
            a.cancel()
        await asyncio.gather(*actors, return_exceptions=True)
        counts = await group_counts(client, keys)
        await client.aclose()
        return ahead, counts

    ahead, counts = run(asyncio.wait_for(scenario(), 120))
    assert len(ahead) == steps and max(ahead) <= 0  # every step reached, never past the bound
    assert counts["failed"]["actor_lost"] >= 1 and counts["failed"]["env_error"] >= 1
    assert balanced(counts)
