"""The partition proxy of the partition test (tests/partition.py) cuts for real: while cut, a
command neither arrives nor fails; on heal, what waited goes through; a connection opened
during the cut waits too."""

import asyncio
import time

import pytest

from broker.connection import connect
from broker.embedded import EmbeddedRedis, find_redis_server
from tests.partition import Partition

pytestmark = pytest.mark.redis


def test_a_cut_link_holds_commands_and_connections_until_it_heals(tmp_path):
    async def scenario(port: int, link: Partition):
        client = connect(f"redis://127.0.0.1:{link.port}/0")
        await client.set("k", "before")
        link.cut()
        await asyncio.sleep(0.1)
        held = asyncio.create_task(client.set("k", "during"))
        await asyncio.sleep(1.0)
        assert not held.done()  # no answer, no error
        direct = connect(f"redis://127.0.0.1:{port}/0")
        assert await direct.get("k") == b"before"  # and it did not arrive
        late = connect(f"redis://127.0.0.1:{link.port}/0")
        with pytest.raises(asyncio.TimeoutError):  # a new connection is accepted, and waits
            await asyncio.wait_for(late.ping(), 1.0)
        link.heal()
        started = time.monotonic()
        await asyncio.wait_for(held, 5)
        assert await direct.get("k") == b"during" and time.monotonic() - started < 1.0
        assert await client.ping()
        for c in (client, direct, late):
            await c.aclose()

    with EmbeddedRedis(binary=find_redis_server(), data_dir=str(tmp_path)) as redis, Partition(redis.port) as link:
        asyncio.run(scenario(redis.port, link))
        assert link.connections >= 2

