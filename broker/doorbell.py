"""Waiting for capacity without polling: a doorbell is a Redis list of tokens.

Whoever frees capacity rings, inside the script that frees it: the bell then holds one token
for each group the capacity can let in now (a publication raises the admission bound, a
released ticket frees a slot, an acknowledgement frees stream space). Waiters block on BLPOP
(one connection a process, `Doorbell`): Redis hands each token to exactly one blocked client,
the oldest first, so a ring wakes as many waiters as there is room for and no more (no herd),
and a ring that comes between a waiter's failed try and its BLPOP is not lost (the token
waits in the list).

A token is a hint, never a permit: the woken waiter tries again through the script that
decides (the admission bound, the stream's length bound), and waits again if it lost the
race. A token lost with its waiter (a process killed between the pop and the try), a ring
that never came (a ticket that expired with its actor) or a Redis that lost the list cost at
most a round of the learner's janitor, which rings every doorbell for the room there is
(`learner.bridge`), or, with no learner to ring, the fallback timeout, after which a waiter
tries anyway. A ring replaces the tokens left from earlier rings, so the list never holds
more than the capacity it announces, and a refused try empties it: tokens rung while nobody
waits wake one waiter at most for nothing.
"""

from __future__ import annotations

import asyncio
import collections

from broker.connection import SOCKET_TIMEOUT_S

# A waiter tries again at least this often, rung or not: the last resort (the learner's janitor
# rings every few seconds). Below the clients' 30 s socket timeout, which a BLPOP must not reach.
FALLBACK_S = 20.0

RING_MAX = 256  # tokens a ring pushes at most; waiters granted with more room left relay the rest

# Lua functions for the scripts that free or take capacity. ring(key, free): the bell holds
# min(free, RING_MAX) tokens (none if free <= 0), whatever it held. relay(key, free): a waiter
# granted with RING_MAX or more groups' room left rings an empty bell, so more waiters than
# one ring wakes are woken in turn (below that, the tokens in flight cover the room).
RING_FN = """
local function ring(key, free)
  redis.call('DEL', key)
  local n = math.min(tonumber(free), %d)
  if n > 0 then
    local tokens = {}
    for i = 1, n do tokens[i] = '1' end
    redis.call('RPUSH', key, unpack(tokens))
  end
end
local function relay(key, free)
  if tonumber(free) >= %d and redis.call('LLEN', key) == 0 then ring(key, free) end
end
""" % (RING_MAX, RING_MAX)


class Doorbell:
    """A process's side of a doorbell (`key`, a list in the slot of the keys whose capacity it
    announces), shared by every waiter of the process (the group loops of an actor): one
    listener blocks on BLPOP while any of them waits and hands each token to the one that has
    waited longest. A thousand loops in four processes hold four blocking connections, and
    the fallback wakes one waiter a process, not every loop. `fallback_s` must stay below the
    client's socket timeout."""

    def __init__(self, client, key: str, fallback_s: float = FALLBACK_S):
        if not 0 < fallback_s < SOCKET_TIMEOUT_S:
            raise ValueError(f"a doorbell's fallback_s must be positive and below the Redis client's socket timeout "
                             f"({SOCKET_TIMEOUT_S:g}s), not {fallback_s}")
        self.client, self.key, self.fallback_s = client, key, fallback_s
        self.rung = self.timed_out = 0  # wake-ups by a token, by the fallback
        self._waiters: collections.deque[asyncio.Future[bool]] = collections.deque()
        self._listener: asyncio.Task | None = None

    async def wait(self, stop: asyncio.Event | None = None) -> bool:
        """Block until this waiter's turn at a token (True), the fallback or `stop` (False).
        A Redis error of the listener's BLPOP is raised here, to the caller's retry policy."""
        turn: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen())
        stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
        try:
            await asyncio.wait({turn} if stopped is None else {turn, stopped}, return_when=asyncio.FIRST_COMPLETED)
            return turn.result() if turn.done() else False
        finally:
            if stopped is not None:
                stopped.cancel()
            if not turn.done():
                turn.cancel()
                self._waiters.remove(turn)

    async def _listen(self) -> None:
        try:
            while self._waiters:
                got = await self.client.blpop([self.key], timeout=self.fallback_s)
                turn = self._waiters.popleft() if self._waiters else None
                if turn is None:  # everyone stopped waiting: the token is another process's
                    if got is not None:
                        await self.client.rpush(self.key, got[1])
                    continue  # a waiter that came meanwhile is served; none: the listener ends
                if got is None:
                    self.timed_out += 1
                else:
                    self.rung += 1
                turn.set_result(got is not None)
        except Exception as exc:  # noqa: BLE001 - each waiter raises it to its own retry policy
            while self._waiters:
                self._waiters.popleft().set_exception(exc)
