"""Weight versions: the record (number, step, transport, byte size, checksum) in a hash,
the bytes as a blob in Redis (the last K kept), and an announcement on a channel that
wakes the receivers (who also poll the record, so a lost announcement costs one poll)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from broker.keys import Keys
from broker.retry import REDIS_TRANSIENT

log = logging.getLogger(__name__)


REDIS_MAX_VALUE = 512 << 20  # Redis's default proto-max-bulk-len: the largest value it accepts


class WeightVersionError(RuntimeError):
    """A blob is gone or does not match its checksum."""


class WeightsTooLarge(ValueError):
    """The blob is over the largest value the server accepts (one SET cannot carry it)."""


class WeightStore:
    def __init__(self, client: aioredis.Redis, keys: Keys, keep: int = 3):
        self.client, self.keys, self.keep = client, keys, keep
        self._max_value: int | None = None

    async def max_value(self) -> int:
        """The server's proto-max-bulk-len, or Redis's default where CONFIG is not allowed."""
        if self._max_value is None:
            try:
                reply = await self.client.config_get("proto-max-bulk-len")
                self._max_value = int(next(iter(reply.values()))) if reply else REDIS_MAX_VALUE
            except ResponseError:  # managed servers often refuse or rename CONFIG
                self._max_value = REDIS_MAX_VALUE
        return self._max_value

    async def publish(self, version: int, step: int, blob: bytes) -> dict[str, Any]:
        # Over the limit the server drops the connection mid-write, which looks like a network
        # fault and would be retried forever: refuse it here, once, saying why.
        limit = await self.max_value()
        if len(blob) > limit:
            raise WeightsTooLarge(
                f"the weights are {len(blob) / 2**20:,.0f} MiB, over the largest value this Redis accepts "
                f"({limit / 2**20:,.0f} MiB, proto-max-bulk-len): the blob transport sends them as "
                f"one value. Use a smaller model or model.dtype=bfloat16, or raise proto-max-bulk-len on the server")
        record = {"version": version, "step": step, "transport": "blob", "nbytes": len(blob),
                  "sha256": hashlib.sha256(blob).hexdigest(), "time": time.time()}
        # One slot ({run}), so one transaction on a cluster too; PUBLISH is not allowed in a
        # cluster pipeline, and the announcement only hurries pollers along, so it goes after.
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.weights_blob(version), blob)
            pipe.hset(self.keys.weights_latest, mapping=record)
            if version - self.keep >= 0:
                pipe.delete(self.keys.weights_blob(version - self.keep))
            await pipe.execute()
        await self.client.publish(self.keys.weights_channel, str(version))
        return record

    async def latest(self) -> dict[str, Any] | None:
        raw = await self.client.hgetall(self.keys.weights_latest)
        if not raw:
            return None
        rec = {k.decode(): v.decode() for k, v in raw.items()}
        return {"version": int(rec["version"]), "step": int(rec["step"]), "transport": rec["transport"],
                "nbytes": int(rec["nbytes"]), "sha256": rec["sha256"], "time": float(rec["time"])}

    async def fetch(self, record: dict[str, Any]) -> bytes:
        blob = await self.client.get(self.keys.weights_blob(record["version"]))
        if blob is None:
            raise WeightVersionError(f"weights of version {record['version']} are no longer stored")
        if len(blob) != record["nbytes"] or hashlib.sha256(blob).hexdigest() != record["sha256"]:
            raise WeightVersionError(f"weights of version {record['version']} fail their checksum")
        return blob


class Announcements:
    """`wait(timeout)` returns when a version is announced, or after `timeout`: a receiver
    applies a new version as soon as it is out instead of at its next poll. Redis Cluster's
    asyncio client has no pub/sub, and a lost connection is subscribed again at the next
    wait: both fall back to waiting the timeout (the poll)."""

    def __init__(self, client: aioredis.Redis, keys: Keys):
        self.client, self.channel = client, keys.weights_channel
        self._pubsub = None

    async def wait(self, timeout: float) -> None:
        if isinstance(self.client, RedisCluster):
            await asyncio.sleep(timeout)
            return
        try:
            if self._pubsub is None:
                self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                await self._pubsub.subscribe(self.channel)
            await self._pubsub.get_message(timeout=timeout)
        except REDIS_TRANSIENT as exc:
            log.debug("weight announcements: %s; polling until the next wait subscribes again", exc)
            await self.close()
            await asyncio.sleep(timeout)

    async def close(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                await pubsub.aclose()
            except REDIS_TRANSIENT:
                pass
