"""Redis clients: binary-safe, TLS when the URL says rediss://, Redis Cluster when asked."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from common.config import UNSET, RedisConfig


def connect(cfg: RedisConfig | str, *, blocking: bool = False) -> Any:
    """A client for redis.url. A client used for blocking reads gets no socket timeout
    (blocking reads hold their connection for the block time)."""
    cfg = RedisConfig(url=cfg) if isinstance(cfg, str) else cfg
    if not cfg.url:
        raise ValueError(f"redis.url is unset: {UNSET['redis.url']}")
    kwargs: dict[str, Any] = dict(decode_responses=False, socket_timeout=None if blocking else 30.0,
                                  socket_connect_timeout=5.0)
    if cfg.url.startswith("rediss://"):
        kwargs.update(ssl_ca_certs=cfg.tls_ca_file, ssl_certfile=cfg.tls_cert_file, ssl_keyfile=cfg.tls_key_file,
                      ssl_cert_reqs="required" if cfg.tls_ca_file else "none")
    if cfg.cluster:
        return RedisCluster.from_url(cfg.url, **kwargs)
    return aioredis.Redis.from_url(cfg.url, health_check_interval=30, **kwargs)
