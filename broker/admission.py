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
  came back this way and is committed after all moves from `actor_lost` to `produced`;
  its room was handed out again meanwhile, so such a late commit takes the count past the
  bound by its group until the learner catches up (the learner still checks each group's
  staleness). A heartbeat well inside `ticket_ttl_s` keeps live actors' tickets from this.
The learner takes a dead-lettered or filtered group out of `accepted` (its ticket comes back) and,
at each publication, floors `accepted` to the groups it has trained on, so a Redis that
lost its data cannot let actors run ahead.

A group refused a ticket waits on the tickets' doorbell (broker/doorbell.py), not by polling:
each publication, released ticket and expired one, and the learner's janitor every few seconds
(`wake_waiting`), ring it for as many groups as the bound lets in now; a refusal empties it.

Everything is one Lua script per operation on keys of the run's hash tag (one slot), with
the server's clock (TIME), so actors on machines whose clocks differ agree on expiry.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from broker.doorbell import FALLBACK_S, RING_FN, Doorbell
from broker.keys import Keys

log = logging.getLogger(__name__)

LOST_KEPT_S = 86_400  # a ticket that came back stays committable this long

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
"""

# The groups the bound lets in now: free(held, accepted, weights_latest, B, slack), counting
# only the tickets not yet expired (the next try returns those).
_FREE_FN = _NOW + """
local function free(held, accepted, latest, B, slack)
  local step = tonumber(redis.call('HGET', latest, 'step') or '0')
  local used = tonumber(redis.call('GET', accepted) or '0') + redis.call('ZCOUNT', held, '(' .. now, '+inf')
  return step * tonumber(B) + tonumber(slack) - used, used
end
"""

# KEYS: held, lost, accepted, weights_latest, counts, doorbell. ARGV: ticket, ttl_s, B, slack = (eta + 1) * B.
# Tickets found expired ring the doorbell for the room they made, a grant relays it, a refusal
# empties it (no room: its tokens were stale).
_ACQUIRE_LUA = RING_FN + _FREE_FN + """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return {1, -1, -1} end  -- granted before, reply lost
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  for _, t in ipairs(expired) do redis.call('ZADD', KEYS[2], now, t) end
  redis.call('HINCRBY', KEYS[5], 'failed:actor_lost', #expired)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - %d)
end
local room, used = free(KEYS[1], KEYS[3], KEYS[4], ARGV[3], ARGV[4])
if room > 0 then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('HINCRBY', KEYS[5], 'started', 1)
  if #expired > 0 then ring(KEYS[6], room - 1) else relay(KEYS[6], room - 1) end
  return {1, used + 1, used + room}
end
ring(KEYS[6], 0)
return {0, used, used + room}
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

# KEYS: held, counts, accepted, weights_latest, doorbell. ARGV: ticket, reason, B, slack.
_RELEASE_LUA = RING_FN + _FREE_FN + """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'failed:' .. ARGV[2], 1)
  ring(KEYS[5], free(KEYS[1], KEYS[3], KEYS[4], ARGV[3], ARGV[4]))
  return 1
end
return 0
"""

# KEYS: held. ARGV: ttl_s, tickets... Only tickets still held are renewed (XX), in one ZADD
# (a thousand a call: unpack() has a stack limit), not one a ticket.
_RENEW_LUA = _NOW + """
local expiry = now + tonumber(ARGV[1])
local args = {}
for i = 2, #ARGV do
  args[#args + 1] = expiry
  args[#args + 1] = ARGV[i]
end
redis.call('ZADD', KEYS[1], 'XX', unpack(args))
return #ARGV - 1
"""

# KEYS: held, lost, counts, accepted, weights_latest, doorbell. ARGV: name prefix, own prefix,
# B, slack. Tickets of earlier incarnations come back.
_RELEASE_PREDECESSORS_LUA = RING_FN + _FREE_FN + """
local n = 0
for _, t in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if string.sub(t, 1, #ARGV[1]) == ARGV[1] and string.sub(t, 1, #ARGV[2]) ~= ARGV[2] then
    redis.call('ZREM', KEYS[1], t)
    redis.call('ZADD', KEYS[2], now, t)
    n = n + 1
  end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[3], 'failed:actor_lost', n)
  ring(KEYS[6], free(KEYS[1], KEYS[4], KEYS[5], ARGV[3], ARGV[4]))
end
return n
"""

# KEYS: accepted, held, weights_latest, doorbell. ARGV: floor, B, slack. Raises the counter to
# the floor, never lowers it, and rings the doorbell for the groups the new bound lets in.
_WAKE_LUA = RING_FN + _FREE_FN + """
local accepted = tonumber(redis.call('GET', KEYS[1]) or '0')
if accepted < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
  accepted = tonumber(ARGV[1])
end
ring(KEYS[4], free(KEYS[2], KEYS[1], KEYS[3], ARGV[2], ARGV[3]))
return accepted
"""


async def wake_waiting(client, keys: Keys, groups_per_step: int, eta: int, trained_groups: int = 0) -> int:
    """The learner, after each publication and every janitor round: at least the groups it
    trained on count as accepted (a Redis that lost the counter cannot let actors run ahead
    of the bound), and the tickets' doorbell is rung for as many groups as the bound lets in
    now (expired tickets count as room), which also heals rings that were lost. Returns
    `accepted`."""
    return int(await client.eval(_WAKE_LUA, 4, keys.tickets_accepted, keys.tickets_held, keys.weights_latest,
                                 keys.tickets_doorbell, trained_groups, groups_per_step,
                                 (eta + 1) * groups_per_step))


async def announce_step(client, keys: Keys, step: int, version: int, trained_groups: int, groups_per_step: int,
                        eta: int) -> int:
    """The learner, once version `version` (step `step`'s weights) is published: its state for
    actors and `omrl status`, then `wake_waiting`. Returns `accepted`."""
    await client.hset(keys.learner_state, mapping={"step": step, "version": version, "groups_trained": trained_groups,
                                                   "time": time.time()})
    return await wake_waiting(client, keys, groups_per_step, eta, trained_groups=trained_groups)


async def group_counts(client, keys: Keys) -> dict[str, Any]:
    """The run's accounting: started = produced + failed + held; produced = trained +
    dead-lettered + filtered (learner.filter_groups) + waiting in the streams (the learner's
    share is in `learner_state`)."""
    raw = {k.decode(): int(v) for k, v in (await client.hgetall(keys.counts)).items()}

    def by_reason(prefix: str) -> dict[str, int]:
        return dict(sorted((k.split(":", 1)[1], v) for k, v in raw.items() if k.startswith(prefix + ":") and v))

    accepted = await client.get(keys.tickets_accepted)
    return {"started": raw.get("started", 0), "produced": raw.get("produced", 0), "failed": by_reason("failed"),
            "dead_lettered": by_reason("dead"), "filtered": by_reason("filtered"),
            "held": int(await client.zcard(keys.tickets_held)), "accepted": int(accepted) if accepted else 0}


class Admission:
    """One actor's side of the tickets. `ticket_ttl_s` is how long a ticket lives without
    a renewal (the actor's heartbeat renews the tickets it holds). A group refused a ticket
    waits on the tickets' doorbell, rung when the bound lets groups in (`fallback_s`: it
    tries again at least this often, rung or not)."""

    def __init__(self, client, keys: Keys, groups_per_step: int, eta: int, ticket_ttl_s: float = 60.0,
                 fallback_s: float = FALLBACK_S):
        self.client, self.keys = client, keys
        self.groups_per_step = groups_per_step
        self.slack = (eta + 1) * groups_per_step  # eta: optimizer steps ahead (learner.steps_ahead)
        self.ttl_s = ticket_ttl_s
        self.doorbell = Doorbell(client, keys.tickets_doorbell, fallback_s)
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._commit = client.register_script(_COMMIT_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._renew = client.register_script(_RENEW_LUA)
        self._predecessors = client.register_script(_RELEASE_PREDECESSORS_LUA)
        self.waited_s = 0.0
        self.waits: collections.deque[tuple[float, float]] = collections.deque(maxlen=10_000)  # (time, s waited)

    async def try_acquire(self, ticket: str) -> bool:
        k = self.keys
        granted, _used, _bound = await self._acquire(
            keys=[k.tickets_held, k.tickets_lost, k.tickets_accepted, k.weights_latest, k.counts, k.tickets_doorbell],
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
            await self.doorbell.wait(stop)
        waited = time.monotonic() - started
        self.waited_s += waited
        self.waits.append((time.time(), waited))
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
        k = self.keys
        return bool(await self._release(
            keys=[k.tickets_held, k.counts, k.tickets_accepted, k.weights_latest, k.tickets_doorbell],
            args=[ticket, reason, self.groups_per_step, self.slack]))

    async def renew(self, tickets: list[str]) -> None:
        for i in range(0, len(tickets), 1000):
            await self._renew(keys=[self.keys.tickets_held], args=[self.ttl_s, *tickets[i:i + 1000]])

    async def release_predecessors(self, name: str, incarnation: str) -> int:
        """Tickets held by earlier processes of actor `name` (dead: this one took its place) come back."""
        k = self.keys
        return int(await self._predecessors(
            keys=[k.tickets_held, k.tickets_lost, k.counts, k.tickets_accepted, k.weights_latest, k.tickets_doorbell],
            args=[f"{name}|", f"{name}|{incarnation}|", self.groups_per_step, self.slack]))
