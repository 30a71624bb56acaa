"""Admission tickets (AReaL-style staleness bound): with learner version V, B groups per
step and bound eta, an actor may start a new group only while
``started < (V + eta + 1) * B``. The check and the increment are one Lua script, so any
number of actors share the bound atomically. Both keys carry the run's hash tag."""

from __future__ import annotations

import asyncio
import logging
import time

from broker.keys import Keys

log = logging.getLogger(__name__)

# KEYS[1] = started counter, KEYS[2] = learner version; ARGV[1] = B, ARGV[2] = eta.
# Returns {granted (0/1), started, version}.
_TICKET_LUA = """
local started = tonumber(redis.call('GET', KEYS[1]) or '0')
local version = tonumber(redis.call('GET', KEYS[2]) or '0')
if started < (version + tonumber(ARGV[2]) + 1) * tonumber(ARGV[1]) then
  started = redis.call('INCR', KEYS[1])
  return {1, started, version}
end
return {0, started, version}
"""


# KEYS[1] = started counter; ARGV[1] = floor. Raises the counter to the floor, never lowers it.
_FLOOR_LUA = """
local started = tonumber(redis.call('GET', KEYS[1]) or '0')
if started < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
  return tonumber(ARGV[1])
end
return started
"""


async def floor_started(client, keys: Keys, version: int, groups_per_step: int) -> int:
    """A learner resuming at version V counts V * B groups as started: otherwise, against a
    Redis that lost the counter, actors could run V * B groups ahead of the bound."""
    return int(await client.eval(_FLOOR_LUA, 1, keys.tickets_started, version * groups_per_step))


class Admission:
    def __init__(self, client, keys: Keys, groups_per_step: int, eta: int, poll_s: float = 0.05):
        self.client, self.keys = client, keys
        self.groups_per_step, self.eta, self.poll_s = groups_per_step, eta, poll_s
        self._script = client.register_script(_TICKET_LUA)
        self.waited_s = 0.0

    async def try_acquire(self) -> bool:
        granted, _started, _version = await self._script(keys=[self.keys.tickets_started, self.keys.learner_version],
                                                         args=[self.groups_per_step, self.eta])
        return bool(granted)

    async def acquire(self, stop: asyncio.Event | None = None) -> bool:
        """Wait for a ticket; False if `stop` was set first."""
        started = time.monotonic()
        logged = False
        while not await self.try_acquire():
            if not logged:
                log.info("staleness bound reached (eta=%d, B=%d): waiting for the learner to publish",
                         self.eta, self.groups_per_step)
                logged = True
            if stop is not None and stop.is_set():
                return False
            await asyncio.sleep(self.poll_s)
        self.waited_s += time.monotonic() - started
        return True
