"""Redis clients: binary-safe, TLS when the URL says rediss://, Redis Cluster when asked."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from common.config import UNSET, RedisConfig

# Every call waits at most this long for its answer, blocking reads included (they block for
# less: XREADGROUP 0.5-1 s, a doorbell's BLPOP broker.doorbell.FALLBACK_S): a hung Redis, stopped
# or cut off, raises redis's TimeoutError, which the retry policy logs, naming the call, and retries.
SOCKET_TIMEOUT_S = 30.0


def connect(cfg: RedisConfig | str) -> Any:
    """A client for redis.url, each call bounded by SOCKET_TIMEOUT_S."""
    cfg = RedisConfig(url=cfg) if isinstance(cfg, str) else cfg
    if not cfg.url:
        raise ValueError(f"redis.url is unset: {UNSET['redis.url']}")
    kwargs: dict[str, Any] = dict(decode_responses=False, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=5.0)
    if cfg.url.startswith("rediss://"):
        kwargs.update(ssl_ca_certs=cfg.tls_ca_file, ssl_certfile=cfg.tls_cert_file, ssl_keyfile=cfg.tls_key_file,
                      ssl_cert_reqs="required" if cfg.tls_ca_file else "none")
    if cfg.cluster:
        cluster = RedisCluster.from_url(cfg.url, **kwargs)
        safe = cancel_safe(cluster.connection_kwargs["connection_class"])
        cluster.connection_kwargs["connection_class"] = safe  # the nodes found later (the nodes manager's dict too)
        for node in cluster.nodes_manager.startup_nodes.values():
            node.connection_class = safe
        return cluster
    client = aioredis.Redis.from_url(cfg.url, health_check_interval=30, **kwargs)
    client.connection_pool.connection_class = cancel_safe(client.connection_pool.connection_class)
    return client


_CANCEL_SAFE: dict[type, type] = {}


def cancel_safe(cls: type) -> type:
    """`cls` (a redis-py asyncio connection class), whose sends never drop a cancellation.

    redis-py sends each command under `asyncio.wait_for` when a socket timeout is set, and
    Python 3.11's `wait_for` returns the result of an inner call that finished in the same
    loop iteration as the caller's cancellation, dropping the cancellation (CPython gh-86296;
    its 3.12 rewrite on `asyncio.timeout` fixed it). Measured here: a task cancelled during a
    GET ran on as if never cancelled in about half of 3,000 tries. A group loop told to stop
    would take its next ticket, a shutdown would wait on it for good. The subclass raises the
    cancellation after the send, closing the connection first (the command's reply is never
    read, so the connection must not serve another)."""
    if sys.version_info >= (3, 12):
        return cls
    if cls not in _CANCEL_SAFE:
        async def send_packed_command(self, command, check_health: bool = True) -> None:
            task = asyncio.current_task()
            before = task.cancelling() if task is not None else 0
            await cls.send_packed_command(self, command, check_health)
            if task is not None and task.cancelling() > before:
                await self.disconnect(nowait=True)
                raise asyncio.CancelledError

        _CANCEL_SAFE[cls] = type(f"CancelSafe{cls.__name__}", (cls,), {"send_packed_command": send_packed_command})
    return _CANCEL_SAFE[cls]
