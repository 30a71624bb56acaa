"""Membership: actors (and the learner) register and send heartbeats into one hash per
run; a member whose last heartbeat is older than `dead_after_s` is reported dead.

Slots give replicas that were started with no index of their own (`docker compose
--scale actor=N`, a Kubernetes Deployment) distinct indexes, hence distinct seeds and task
orders, and one evaluator (index 0). An actor keeps its slot across restarts (same name:
a restarted container keeps its hostname) and frees it when it stops cleanly; a slot whose
holder has not renewed it for `SLOT_STALE_S` is free again (a replica killed and removed).
A new actor takes the lowest free index, so a run that scaled down and up again has an
evaluator and indexes 0..N-1.
"""

from __future__ import annotations

import json
import time
from typing import Any

from broker.keys import Keys

SLOT_STALE_S = 600.0  # longer than any engine start: a slot is renewed with each heartbeat

# KEYS: slots. ARGV: name, stale_s, the index the actor was given (-1: none).
# Returns {index, starts before this one}.
_CLAIM_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local used, mine, starts = {}, nil, 0
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local name = entries[i]
  local index, count, renewed = string.match(entries[i + 1], '^(%d+) (%d+) ([%d.]+)$')
  index, count = tonumber(index), tonumber(count)
  if name == ARGV[1] then
    mine, starts = index, count
  elseif now - tonumber(renewed) > tonumber(ARGV[2]) then
    redis.call('HDEL', KEYS[1], name)
  else
    used[index] = true
  end
end
if tonumber(ARGV[3]) >= 0 then
  mine = tonumber(ARGV[3])
elseif mine == nil or used[mine] then
  mine = 0
  while used[mine] do mine = mine + 1 end
end
redis.call('HSET', KEYS[1], ARGV[1], mine .. ' ' .. (starts + 1) .. ' ' .. now)
return {mine, starts}
"""

# KEYS: slots. ARGV: name. Renews the slot if the actor still holds it; 0 if it lost it.
_RENEW_LUA = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held then return 0 end
local t = redis.call('TIME')
local index, count = string.match(held, '^(%d+) (%d+) ')
redis.call('HSET', KEYS[1], ARGV[1], index .. ' ' .. count .. ' ' .. (tonumber(t[1]) + tonumber(t[2]) / 1e6))
return 1
"""


class Membership:
    def __init__(self, client, keys: Keys):
        self.client, self.keys = client, keys

    async def heartbeat(self, member_id: str, **info: Any) -> None:
        record = {"id": member_id, "last_seen": time.time(), **info}
        await self.client.hset(self.keys.members, member_id, json.dumps(record))

    async def leave(self, member_id: str) -> None:
        await self.client.hdel(self.keys.members, member_id)
        await self.client.hdel(self.keys.actor_slots, member_id)

    async def claim_slot(self, name: str, given: int | None = None, stale_s: float = SLOT_STALE_S) -> tuple[int, int]:
        """(index, starts): the slot of actor `name` (its own again after a restart; `given`
        when the actor was started with an index) and how many times a process of that name
        started before this one."""
        index, starts = await self.client.eval(_CLAIM_LUA, 1, self.keys.actor_slots, name, stale_s,
                                               -1 if given is None else given)
        return int(index), int(starts)

    async def renew_slot(self, name: str) -> bool:
        return bool(await self.client.eval(_RENEW_LUA, 1, self.keys.actor_slots, name))

    async def slots(self) -> dict[str, int]:
        """Actor name -> index, for every slot held."""
        return {name if isinstance(name, str) else name.decode(): int(record.split()[0])
                for name, record in (await self.client.hgetall(self.keys.actor_slots)).items()}

    async def members(self, dead_after_s: float) -> list[dict[str, Any]]:
        now = time.time()
        out = []
        for raw in (await self.client.hgetall(self.keys.members)).values():
            record = json.loads(raw)
            record["silent_s"] = now - record["last_seen"]
            # A member may say it will be quiet longer (an actor starting its engine: `quiet_s`).
            record["alive"] = record["silent_s"] <= max(dead_after_s, record.get("quiet_s", 0))
            out.append(record)
        return sorted(out, key=lambda r: r["id"])
