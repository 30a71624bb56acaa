"""The doorbell on real Redis servers (6.2 and 7): the waiters of a process share one blocking
connection, take tokens oldest first, one each; a stopped waiter leaves at once and a token
nobody in the process waits for goes back for another process; a dropped connection is raised
to every waiter."""

import asyncio
import time

import pytest
import redis

from broker.connection import connect
from broker.doorbell import Doorbell

pytestmark = pytest.mark.redis


def test_waiters_share_one_blocking_connection_and_take_tokens_in_turn(redis_server_url, run_name):
    key = f"{run_name}:bell"

    async def scenario():
        client, admin = connect(redis_server_url), connect(redis_server_url)
        bell = Doorbell(client, key, fallback_s=20.0)
        stop = asyncio.Event()
        woken: list[int] = []

        async def waiter(i: int) -> bool:
            got = await bell.wait(stop)
            if got:
                woken.append(i)
            return got

        tasks = []
        for i in range(50):
            tasks.append(asyncio.create_task(waiter(i)))
            await asyncio.sleep(0.002)  # in this order
        await asyncio.sleep(0.3)
        assert (await admin.info("clients"))["blocked_clients"] == 1  # one BLPOP for 50 waiters
        await admin.rpush(key, "1", "1", "1")
        deadline = time.monotonic() + 5
        while len(woken) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert woken == [0, 1, 2]  # the three that waited longest, no more
        stop.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 2)  # a stop ends the waits at once
        assert sum(results) == 3
        await admin.rpush(key, "1")  # the listener, still blocked, takes it: nobody here waits, so it goes back
        deadline = time.monotonic() + 5
        while bell._listener is not None and not bell._listener.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert bell._listener.done() and await admin.llen(key) == 1
        assert (bell.rung, bell.timed_out) == (3, 0)
        await client.aclose()
        await admin.aclose()
    asyncio.run(scenario())


def test_a_dropped_connection_is_raised_to_every_waiter(redis_server_url, run_name):
    async def scenario():
        client, admin = connect(redis_server_url), connect(redis_server_url)
        bell = Doorbell(client, f"{run_name}:bell", fallback_s=20.0)
        tasks = [asyncio.create_task(bell.wait()) for _ in range(3)]
        await asyncio.sleep(0.3)
        await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
        assert all(isinstance(r, redis.exceptions.ConnectionError) for r in results), results
        await client.aclose()
        await admin.aclose()
    asyncio.run(scenario())
