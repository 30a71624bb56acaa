"""Membership: actors (and the learner) register and send heartbeats into one hash per
run; a member whose last heartbeat is older than `dead_after_s` is reported dead."""

from __future__ import annotations

import json
import time
from typing import Any

from broker.keys import Keys


class Membership:
    def __init__(self, client, keys: Keys):
        self.client, self.keys = client, keys

    async def heartbeat(self, member_id: str, **info: Any) -> None:
        record = {"id": member_id, "last_seen": time.time(), **info}
        await self.client.hset(self.keys.members, member_id, json.dumps(record))

    async def leave(self, member_id: str) -> None:
        await self.client.hdel(self.keys.members, member_id)

    async def members(self, dead_after_s: float) -> list[dict[str, Any]]:
        now = time.time()
        out = []
        for raw in (await self.client.hgetall(self.keys.members)).values():
            record = json.loads(raw)
            record["silent_s"] = now - record["last_seen"]
            record["alive"] = record["silent_s"] <= dead_after_s
            out.append(record)
        return sorted(out, key=lambda r: r["id"])
