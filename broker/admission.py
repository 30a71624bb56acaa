"""Admission tickets (AReaL-style staleness bound), which are never leaked.

With B groups per step, S the step whose weights the newest published version holds and the
bound eta (in optimizer steps), an actor may start a new group only while

    accepted + held < S * B + (eta + 1) * B

where `accepted` counts groups written to the streams and not dead-lettered, and `held`
counts tickets of groups running now. Consumed in the order they started, the group numbered
n (from 0) is trained at step n // B + 1, on weights n // B steps old, so every group is at
most eta optimizer steps stale, whatever `learner.publish_every` is (a version published
every k steps makes a group up to k - 1 steps stale, so eta must be at least k - 1: the config
refuses less). One that takes much longer than those started after it can be staler (the
learner logs each group's staleness and dead-letters those past `learner.max_staleness`).

Every ticket has an id (`actor name|incarnation|n`) and an expiry in a sorted set. It ends
in exactly one way, each counted in the run's `counts` hash:
- `commit` after the group's XADD: the ticket becomes `accepted` (`produced`);
- `release` when the group fails or is cancelled (`failed:<reason>`);
- expiry, when its actor sent no heartbeat for `ticket_ttl_s`, or `release_predecessors`,
  when a restarted actor of the same name starts (`failed:actor_lost`). A ticket that
  came back this way and is committed after all moves from `actor_lost` to `produced`.
The learner takes a dead-lettered group out of `accepted` (its ticket comes back) and,
at each publication, floors `accepted` to the groups it has trained on, so a Redis that
lost its data cannot let actors run ahead.

Everything is one Lua script per operation on keys of the run's hash tag (one slot), with
the server's clock (TIME), so actors on machines whose clocks differ agree on expiry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from broker.keys import Keys

log = logging.getLogger(__name__)

LOST_KEPT_S = 86_400  # a ticket that came back stays committable this long

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
"""

# KEYS: held, lost, accepted, weights_latest, counts. ARGV: ticket, ttl_s, B, slack = (eta + 1) * B.
_ACQUIRE_LUA = _NOW + """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return {1, -1, -1} end  -- granted before, reply lost
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  for _, t in ipairs(expired) do redis.call('ZADD', KEYS[2], now, t) end
  redis.call('HINCRBY', KEYS[5], 'failed:actor_lost', #expired)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - %d)
end
local step = tonumber(redis.call('HGET', KEYS[4], 'step') or '0')
local bound = step * tonumber(ARGV[3]) + tonumber(ARGV[4])
local used = tonumber(redis.call('GET', KEYS[3]) or '0') + redis.call('ZCARD', KEYS[1])
if used < bound then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('HINCRBY', KEYS[5], 'started', 1)
  return {1, used + 1, bound}
end
return {0, used, bound}
""" % LOST_KEPT_S

# The ticket's group is in a stream: 1 (held), 2 (had come back), 0 (already committed: a
# retried commit finds nothing). A Lua function, so the producer's XADD script commits too.
COMMIT_FN = """
local function commit(held, lost, accepted, counts, ticket)
  if redis.call('ZREM', held, ticket) == 1 then
    redis.call('INCR', accepted)
    redis.call('HINCRBY', counts, 'produced', 1)
    return 1
  end
  if redis.call('ZREM', lost, ticket) == 1 then
    redis.call('INCR', accepted)
    redis.call('HINCRBY', counts, 'produced', 1)
    redis.call('HINCRBY', counts, 'failed:actor_lost', -1)
    return 2
  end
  return 0
end
"""

# KEYS: held, lost, accepted, counts. ARGV: ticket.
_COMMIT_LUA = COMMIT_FN + "return commit(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1])\n"

# KEYS: held, counts. ARGV: ticket, reason.
_RELEASE_LUA = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'failed:' .. ARGV[2], 1)
  return 1
end
return 0
"""

# KEYS: held. ARGV: ttl_s, tickets... Only tickets still held are renewed (XX).
_RENEW_LUA = _NOW + """
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i]) end
return #ARGV - 1
"""

# KEYS: held, lost, counts. ARGV: name prefix, own prefix. Tickets of earlier incarnations come back.
_RELEASE_PREDECESSORS_LUA = _NOW + """
local n = 0
for _, t in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if string.sub(t, 1, #ARGV[1]) == ARGV[1] and string.sub(t, 1, #ARGV[2]) ~= ARGV[2] then
    redis.call('ZREM', KEYS[1], t)
    redis.call('ZADD', KEYS[2], now, t)
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[3], 'failed:actor_lost', n) end
return n
"""

# KEYS: accepted. ARGV: floor. Raises the counter to the floor, never lowers it.
_FLOOR_LUA = """
local accepted = tonumber(redis.call('GET', KEYS[1]) or '0')
if accepted < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
  return tonumber(ARGV[1])
end
return accepted
"""


async def floor_accepted(client, keys: Keys, trained_groups: int) -> int:
    """The learner, at each publication: at least the groups it trained on count as accepted,
    so a Redis that lost the counter cannot let actors run ahead of the bound."""
    return int(await client.eval(_FLOOR_LUA, 1, keys.tickets_accepted, trained_groups))


async def group_counts(client, keys: Keys) -> dict[str, Any]:
    """The run's accounting: started = produced + failed + held; produced = trained +
    dead-lettered + waiting in the streams (the learner's share is in `learner_state`)."""
    raw = {k.decode(): int(v) for k, v in (await client.hgetall(keys.counts)).items()}
    failed = {k.split(":", 1)[1]: v for k, v in raw.items() if k.startswith("failed:") and v}
    dead = {k.split(":", 1)[1]: v for k, v in raw.items() if k.startswith("dead:") and v}
    accepted = await client.get(keys.tickets_accepted)
    return {"started": raw.get("started", 0), "produced": raw.get("produced", 0), "failed": dict(sorted(failed.items())),
            "dead_lettered": dict(sorted(dead.items())), "held": int(await client.zcard(keys.tickets_held)),
            "accepted": int(accepted) if accepted else 0}


class Admission:
    """One actor's side of the tickets. `ticket_ttl_s` is how long a ticket lives without
    a renewal (the actor's heartbeat renews the tickets it holds)."""

    def __init__(self, client, keys: Keys, groups_per_step: int, eta: int, ticket_ttl_s: float = 60.0,
                 poll_s: float = 0.05):
        self.client, self.keys = client, keys
        self.groups_per_step = groups_per_step
        self.slack = (eta + 1) * groups_per_step  # eta: optimizer steps ahead (learner.steps_ahead)
        self.ttl_s, self.poll_s = ticket_ttl_s, poll_s
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._commit = client.register_script(_COMMIT_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._renew = client.register_script(_RENEW_LUA)
        self._predecessors = client.register_script(_RELEASE_PREDECESSORS_LUA)
        self.waited_s = 0.0

    async def try_acquire(self, ticket: str) -> bool:
        k = self.keys
        granted, _used, _bound = await self._acquire(
            keys=[k.tickets_held, k.tickets_lost, k.tickets_accepted, k.weights_latest, k.counts],
            args=[ticket, self.ttl_s, self.groups_per_step, self.slack])
        return bool(granted)

    async def acquire(self, ticket: str, stop: asyncio.Event | None = None) -> bool:
        """Wait for a ticket; False if `stop` was set first."""
        started = time.monotonic()
        logged = False
        while not await self.try_acquire(ticket):
            if not logged:
                log.info("staleness bound reached (%d groups ahead of the newest version's step): "
                         "waiting for the learner to publish", self.slack)
                logged = True
            if stop is not None and stop.is_set():
                return False
            await asyncio.sleep(self.poll_s)
        self.waited_s += time.monotonic() - started
        return True

    @property
    def commit_keys(self) -> list[str]:
        """The keys COMMIT_FN's commit(...) takes, in order."""
        k = self.keys
        return [k.tickets_held, k.tickets_lost, k.tickets_accepted, k.counts]

    async def commit(self, ticket: str) -> int:
        """The ticket's group is in a stream: 1 (held), 2 (had come back), 0 (already committed)."""
        return int(await self._commit(keys=self.commit_keys, args=[ticket]))

    async def release(self, ticket: str, reason: str) -> bool:
        """The ticket's group failed or was cancelled: the ticket comes back, counted under `reason`."""
        return bool(await self._release(keys=[self.keys.tickets_held, self.keys.counts], args=[ticket, reason]))

    async def renew(self, tickets: list[str]) -> None:
        if tickets:
            await self._renew(keys=[self.keys.tickets_held], args=[self.ttl_s, *tickets])

    async def release_predecessors(self, name: str, incarnation: str) -> int:
        """Tickets held by earlier processes of actor `name` (dead: this one took its place) come back."""
        k = self.keys
        return int(await self._predecessors(keys=[k.tickets_held, k.tickets_lost, k.counts],
                                            args=[f"{name}|", f"{name}|{incarnation}|"]))
