"""Weight versions: the record (number, step, transport, byte size, checksum) in a hash,
the bytes as a blob in Redis (the last K kept), and an announcement on a channel."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import redis.asyncio as aioredis

from broker.keys import Keys


class WeightVersionError(RuntimeError):
    """A blob is gone or does not match its checksum."""


class WeightStore:
    def __init__(self, client: aioredis.Redis, keys: Keys, keep: int = 3):
        self.client, self.keys, self.keep = client, keys, keep

    async def publish(self, version: int, step: int, blob: bytes) -> dict[str, Any]:
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
