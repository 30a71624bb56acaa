"""The broker in deployed shapes: sharded streams on a real local Redis Cluster, and a
password, an ACL user and TLS (rediss://) on a real server."""

import asyncio
import shutil
import time

import numpy as np
import pytest
from redis.exceptions import AuthenticationError, NoPermissionError

from broker.admission import Admission
from broker.connection import connect
from broker.keys import Keys
from broker.retry import RetryPolicy
from broker.streams import RolloutProducer
from broker.weights import WeightStore
from common.config import RedisConfig
from common.messages import encode_group
from learner.bridge import BrokerBridge
from tests.groups import synthetic_group
from tests.servers import has_tls, local_cluster, redis_binaries, tls_acl_server

pytestmark = pytest.mark.redis


async def produce(cfg: RedisConfig, n: int, producers: int = 3) -> list[str]:
    """`producers` actors' producers push n groups between them; returns the group ids."""
    client = connect(cfg)
    keys = Keys(cfg.run, cfg.shards)
    rng = np.random.default_rng(0)
    groups = [synthetic_group(rng) for _ in range(n)]
    prods = [RolloutProducer(client, keys, cfg.max_stream_len, retry=RetryPolicy(attempts=5)) for _ in range(producers)]
    flushers = [asyncio.create_task(p.run()) for p in prods]
    for i, g in enumerate(groups):
        await prods[i % producers].push(encode_group(g))
    await asyncio.gather(*[p.flush() for p in prods])
    for f in flushers:
        f.cancel()
    await client.aclose()
    return [g.group_id for g in groups]


def consume(cfg: RedisConfig, n: int, timeout: float = 60) -> list[str]:
    """The learner's bridge (one reader task per stream) reads and acknowledges n groups."""
    bridge = BrokerBridge(cfg, consumer="learner-0", keep_versions=2, queue_size=64, read_count=8).start()
    got = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n and time.monotonic() < deadline:
            d = bridge.get(timeout=0.5)
            if d is not None:
                got.append(d)
        bridge.ack(got)
    finally:
        bridge.stop()
    return [d.group.group_id for d in got]


@pytest.mark.parametrize("binary", redis_binaries())
def test_sharded_streams_on_a_real_cluster(tmp_path, run_name, binary):
    with local_cluster(binary, tmp_path) as ports:
        cfg = RedisConfig(url=f"redis://127.0.0.1:{ports[0]}/0", cluster=True, shards=4, run=run_name, max_stream_len=64)
        produced = asyncio.run(produce(cfg, 40))
        consumed = consume(cfg, 40)
        assert sorted(consumed) == sorted(produced) and len(set(consumed)) == 40

        async def inspect():
            client = connect(cfg)
            keys = Keys(run_name, 4)
            lengths = [await client.xlen(s) for s in keys.streams]
            nodes = {client.get_node_from_key(s).port for s in keys.streams}
            # Run-level keys share one slot, so the admission script and weight publication work.
            store = WeightStore(client, keys)
            await store.publish(1, 1, b"w" * 10)
            assert (await store.latest())["version"] == 1
            assert await Admission(client, keys, 2, 0).try_acquire("actor|1|0")
            await client.aclose()
            return lengths, nodes

        lengths, nodes = asyncio.run(inspect())
        assert lengths == [0, 0, 0, 0]  # every group acknowledged and deleted
        assert len(nodes) >= 2  # the shards spread over the cluster's nodes


@pytest.mark.skipif(not (shutil.which("redis-server") and has_tls(shutil.which("redis-server"))
                         and shutil.which("openssl")), reason="needs a TLS-enabled redis-server and openssl")
def test_tls_password_and_acl_user(tmp_path, run_name):
    binary = shutil.which("redis-server")
    with tls_acl_server(binary, tmp_path, user="omrl", password="s3cret") as port:
        ca = str(tmp_path / "ca.crt")
        cfg = RedisConfig(url=f"rediss://omrl:s3cret@127.0.0.1:{port}/0", tls_ca_file=ca, run=run_name)
        produced = asyncio.run(produce(cfg, 6))
        assert sorted(consume(cfg, 6)) == sorted(produced)

        async def refusals():
            wrong = connect(RedisConfig(url=f"rediss://omrl:wrong@127.0.0.1:{port}/0", tls_ca_file=ca))
            with pytest.raises(AuthenticationError):
                await wrong.ping()
            await wrong.aclose()
            user = connect(cfg)
            with pytest.raises(NoPermissionError):
                await user.set("not-omrl:key", 1)  # the ACL user is limited to omrl:* keys
            await user.aclose()
            plain = connect(RedisConfig(url=f"redis://omrl:s3cret@127.0.0.1:{port}/0"))
            with pytest.raises(Exception):  # noqa: B017 - a TLS port does not speak plain TCP: any failure
                await plain.ping()
            await plain.aclose()

        asyncio.run(refusals())
