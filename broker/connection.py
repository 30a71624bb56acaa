"""Redis clients: binary-safe, TLS when the URL says rediss://, Redis Cluster when asked."""

from __future__ import annotations

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
        return RedisCluster.from_url(cfg.url, **kwargs)
    return aioredis.Redis.from_url(cfg.url, health_check_interval=30, **kwargs)
