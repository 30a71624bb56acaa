"""The rollouts streams: producers XADD encoded groups, the learner reads them through a
consumer group, acknowledges them after the step that used them is committed (XACK then
XDEL, one script), and moves what it cannot use to the dead-letter stream with the reason,
exactly once (the stream is capped; the counts by reason are kept whole in the run's
`counts` hash).

Nothing is trimmed: back-pressure makes producers wait while a stream is full, on the
stream's doorbell (broker/doorbell.py), which the learner's acknowledgements ring for the room
they make. Producers keep a bounded local buffer and retry by a declared policy while Redis
is unreachable.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Container
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from broker.admission import COMMIT_FN, Admission
from broker.doorbell import FALLBACK_S, RING_FN, Doorbell
from broker.keys import Keys
from broker.retry import RetryPolicy

log = logging.getLogger(__name__)

PAYLOAD_FIELD = b"g"

# The back-pressure check and the XADD in one round trip, and exact: no other producer adds
# between them. KEYS: the stream, its doorbell, then the ticket's commit keys where the group's
# ticket is committed with it (one slot). ARGV: the length bound (0: none), the field, the
# payload, then the ticket. A full stream adds nothing, empties the doorbell (its tokens were
# stale: there is no room) and answers nil; an add that leaves room relays the doorbell.
_ADD_LUA = COMMIT_FN + RING_FN + """
local bound = tonumber(ARGV[1])
if bound > 0 and redis.call('XLEN', KEYS[1]) >= bound then
  ring(KEYS[2], 0)
  return false
end
local id = redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[3])
if bound > 0 then relay(KEYS[2], bound - redis.call('XLEN', KEYS[1])) end
if #KEYS > 2 then commit(KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[4]) end
return id
"""


def _id(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


class Entry(NamedTuple):
    """One stream entry as read: its id, its payload (None if it was deleted while pending)
    and how many times it has been delivered, this delivery included."""

    id: str
    data: bytes | None
    deliveries: int


class RolloutProducer:
    """Pushes encoded rollout groups, round-robin over the run's streams.

    `push` puts the group in a bounded local buffer (waiting while it is full); a flusher
    task writes it to Redis, waiting while the stream is full and retrying by `retry`
    while Redis is unreachable, then commits the group's admission ticket. The length
    check and the XADD are one script (one round trip; producers never overshoot the
    bound). A retried XADD whose reply was lost can write a group twice; the learner
    de-duplicates by group id.
    """

    def __init__(self, client: aioredis.Redis, keys: Keys, max_len: int, buffer_size: int = 64,
                 retry: RetryPolicy = RetryPolicy(), fallback_s: float = FALLBACK_S, admission: Admission | None = None):
        self.client, self.keys, self.max_len, self.retry = client, keys, max_len, retry
        self.admission = admission
        self.doorbells = [Doorbell(client, keys.space_doorbell(i), fallback_s) for i in range(keys.shards)]
        self._buffer: asyncio.Queue[tuple[bytes, str | None]] = asyncio.Queue(buffer_size)
        self._shards = itertools.cycle(range(keys.shards))
        self.waited_s = 0.0
        self.unbounded = asyncio.Event()  # set when stopping: finished groups go out past the length bound
        self.tickets: set[str] = set()  # admission tickets of the groups not yet committed
        self._add_script = client.register_script(_ADD_LUA)

    async def push(self, data: bytes, ticket: str | None = None) -> None:
        await self._buffer.put((data, ticket))
        if ticket is not None:
            self.tickets.add(ticket)

    @property
    def buffered(self) -> int:
        return self._buffer.qsize()

    async def flush(self) -> None:
        """Wait until every buffered group is in Redis."""
        await self._buffer.join()

    async def run(self) -> None:
        """The flusher: runs until cancelled. With one stream (the run's hash tag, like the
        tickets) the XADD and the ticket's commit are one script: a producer killed between
        them can never leave a group in the stream whose ticket comes back as lost."""
        while True:
            data, ticket = await self._buffer.get()
            shard = next(self._shards)
            together = (ticket is not None and self.admission is not None and self.keys.shards == 1
                        and not isinstance(self.client, RedisCluster))
            await self.retry.run("XADD to the rollouts stream",
                                 lambda: self._add(shard, data, ticket if together else None))
            if ticket is not None:
                if self.admission is not None and not together:
                    await self.retry.run("commit the admission ticket", lambda: self.admission.commit(ticket))
                self.tickets.discard(ticket)
            self._buffer.task_done()

    async def _add(self, shard: int, data: bytes, ticket: str | None = None) -> str:
        started = time.monotonic()
        stream = self.keys.rollouts(shard)
        keys = [stream, self.keys.space_doorbell(shard), *(self.admission.commit_keys if ticket is not None else [])]
        tail = [PAYLOAD_FIELD, data, *([ticket] if ticket is not None else [])]
        logged = False
        while (entry_id := await self._add_script(keys=keys, args=[0 if self.unbounded.is_set() else self.max_len,
                                                                   *tail])) is None:
            if not logged:
                log.info("rollouts stream %s full (%d groups): waiting for the learner", stream, self.max_len)
                logged = True
            await self.doorbells[shard].wait(self.unbounded)
        self.waited_s += time.monotonic() - started
        return _id(entry_id)


# The room a stream has, rung on its doorbell: room(stream, max_len) (0: no bound, no ring).
_ROOM_FN = RING_FN + """
local function room(stream, doorbell, max_len)
  if tonumber(max_len) > 0 then ring(doorbell, tonumber(max_len) - redis.call('XLEN', stream)) end
end
"""

# KEYS: stream, its doorbell. ARGV: max_len.
_ROOM_LUA = _ROOM_FN + "room(KEYS[1], KEYS[2], ARGV[1])\n"

# KEYS: stream, its doorbell. ARGV: group, max_len, entry ids...
_ACK_LUA = _ROOM_FN + """
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3))
redis.call('XDEL', KEYS[1], unpack(ARGV, 3))
room(KEYS[1], KEYS[2], ARGV[2])
return 1
"""

# KEYS: stream, dead letters, counts, accepted, the stream's doorbell. ARGV: group, entry id,
# max_len, reason, detail, stream name, data, the stream's max_len, kept ("1": into the dead
# letters, counted dead:REASON; "0": filtered, counted filtered:REASON only). All keys but the
# stream's carry the run's hash tag (one slot with one stream, so one script on a cluster too).
_DEAD_LETTER_LUA = _ROOM_FN + """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  if ARGV[9] == '1' then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'reason', ARGV[4], 'detail', ARGV[5],
               'stream', ARGV[6], 'entry', ARGV[2], 'data', ARGV[7])
    redis.call('HINCRBY', KEYS[3], 'dead:' .. ARGV[4], 1)
  else
    redis.call('HINCRBY', KEYS[3], 'filtered:' .. ARGV[4], 1)
  end
  redis.call('DECR', KEYS[4])
end
redis.call('XDEL', KEYS[1], ARGV[2])
room(KEYS[1], KEYS[5], ARGV[8])
return 1
"""


class RolloutConsumer:
    """Reads one stream for one named consumer of the learner's consumer group.

    A (re)started consumer first reads its own pending entries once, in order, with a
    cursor (each XREADGROUP with an id returns the entries after it), then new ones (>).
    Acknowledging rings the stream's doorbell for the room there is under `max_len`, the
    producers' bound (0: rings nothing; producers then try again after their fallback).
    """

    def __init__(self, client: aioredis.Redis, keys: Keys, consumer: str, shard: int = 0, max_len: int = 0):
        self.client, self.keys, self.consumer, self.shard, self.max_len = client, keys, consumer, shard, max_len
        self.stream = keys.rollouts(shard)
        self._ack = client.register_script(_ACK_LUA)
        self.group = keys.consumer_group
        self.pending_cursor: str | None = "0"  # None: own pending entries have been read

    def rewind(self) -> None:
        """Read own pending entries again from the start (after a restart, say)."""
        self.pending_cursor = "0"

    async def ensure_group(self) -> None:
        try:
            await self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, count: int, block_ms: int = 1000) -> list[Entry]:
        """Own pending entries first, each once, then new ones."""
        if self.pending_cursor is not None:
            entries = await self._xreadgroup(self.pending_cursor, count, None)
            if entries:
                self.pending_cursor = entries[-1][0]
                return await self._with_deliveries(entries)
            self.pending_cursor = None
        return [Entry(e, d, 1) for e, d in await self._xreadgroup(">", count, block_ms)]

    async def _xreadgroup(self, start: str, count: int, block_ms: int | None) -> list[tuple[str, bytes | None]]:
        reply = await self.client.xreadgroup(self.group, self.consumer, {self.stream: start}, count=count, block=block_ms)
        return [(_id(entry_id), (fields or {}).get(PAYLOAD_FIELD))
                for _stream, entries in (reply or []) for entry_id, fields in entries]

    async def _with_deliveries(self, entries: list[tuple[str, bytes | None]]) -> list[Entry]:
        rows = await self.client.xpending_range(self.stream, self.group, min=entries[0][0], max=entries[-1][0],
                                                count=len(entries), consumername=self.consumer)
        counts = {_id(r["message_id"]): int(r["times_delivered"]) for r in rows}
        return [Entry(e, d, counts.get(e, 1)) for e, d in entries]

    async def ack(self, entry_ids: list[str]) -> None:
        """Acknowledge and delete the entries (a script a thousand: Lua's unpack has a stack
        limit), and ring the room they made."""
        for i in range(0, len(entry_ids), 1000):
            await self._ack(keys=[self.stream, self.keys.space_doorbell(self.shard)],
                            args=[self.group, self.max_len, *entry_ids[i:i + 1000]])

    async def ring_room(self) -> None:
        """Ring the stream's doorbell for the room it has now (the learner's janitor)."""
        if self.max_len:
            await self.client.eval(_ROOM_LUA, 2, self.stream, self.keys.space_doorbell(self.shard), self.max_len)

    async def dead_letter(self, entry_id: str, data: bytes | None, reason: str, detail: str = "",
                          max_len: int = 10_000) -> None:
        """Move an entry to the dead-letter stream (capped at about `max_len` entries) with its
        reason, count it, give its admission ticket back and acknowledge it: one script, so a
        Redis killed in the middle, or a retry after a lost reply, never moves it twice (an
        entry no longer pending was moved already)."""
        log.warning("dead letter %s %s: %s %s", self.stream, entry_id, reason, detail)
        await self._set_aside(entry_id, reason, detail[:1000], data or b"", max_len, kept=True)

    async def filter(self, entry_id: str, reason: str) -> None:
        """Take an entry out untrained for `reason` (learner.filter_groups: no signal): counted as
        filtered, its admission ticket given back and acknowledged, as a dead letter is, but
        not kept. One script, so a retry never counts it twice."""
        await self._set_aside(entry_id, reason, "", b"", 0, kept=False)

    async def _set_aside(self, entry_id: str, reason: str, detail: str, data: bytes, max_len: int, kept: bool) -> None:
        keys = [self.stream, self.keys.dead_letters, self.keys.counts, self.keys.tickets_accepted,
                self.keys.space_doorbell(self.shard)]
        await self.client.eval(_DEAD_LETTER_LUA, len(keys), *keys, self.group, entry_id, max_len, reason, detail,
                               self.stream, data, self.max_len, "1" if kept else "0")

    async def claim_idle(self, min_idle_ms: int, held: Container[str] = (), count: int = 100) -> list[Entry]:
        """Claim entries pending longer than `min_idle_ms` that nobody is working on: those of
        other consumers (dead ones), and this consumer's own entries that it does not hold
        (`held`), which a read whose reply was lost delivered to it unseen. Entries it holds
        are never claimed: that would bump their delivery count while they wait for a
        checkpoint. Own entries are left alone while the pending cursor still runs.
        A claimed entry whose payload was deleted is acknowledged (Redis 6.2 claims it as
        (None, None); 7.x drops it from the pending list)."""
        out: list[Entry] = []
        start = "-"
        while True:
            rows = await self.client.xpending_range(self.stream, self.group, min=start, max="+", count=count,
                                                    idle=min_idle_ms)
            wanted = {}
            for r in rows:
                entry_id, owner = _id(r["message_id"]), _id(r["consumer"])
                if owner != self.consumer or (self.pending_cursor is None and entry_id not in held):
                    wanted[entry_id] = int(r["times_delivered"])
            if wanted:
                claimed = await self.client.xclaim(self.stream, self.group, self.consumer, min_idle_ms, list(wanted))
                got = {_id(e): (f or {}).get(PAYLOAD_FIELD) for e, f in claimed if e is not None}
                out += [Entry(e, d, wanted[e] + 1) for e, d in got.items()]
                for e in wanted.keys() - got.keys():
                    if await self._owns(e):  # claimed, payload gone (Redis 6.2)
                        await self.ack([e])
            if len(rows) < count:
                return out
            start = "(" + _id(rows[-1]["message_id"])

    async def _owns(self, entry_id: str) -> bool:
        rows = await self.client.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        return bool(rows) and _id(rows[0]["consumer"]) == self.consumer

    async def remove_gone_consumers(self, idle_ms: int) -> list[str]:
        """Delete consumers other than this one that hold nothing and were idle longer than `idle_ms`."""
        removed = []
        for info in await self.client.xinfo_consumers(self.stream, self.group):
            name = _id(info["name"])
            if name != self.consumer and int(info["pending"]) == 0 and int(info["idle"]) > idle_ms:
                await self.client.xgroup_delconsumer(self.stream, self.group, name)
                removed.append(name)
        return removed


async def stream_info(client: aioredis.Redis, keys: Keys, shard: int) -> dict[str, Any]:
    """Length, pending count and lag of one stream (lag from XINFO on Redis 7, computed on 6.2)."""
    stream = keys.rollouts(shard)
    length = await client.xlen(stream)
    groups = await client.xinfo_groups(stream) if await client.exists(stream) else []
    info = next((g for g in groups if _id(g["name"]) == keys.consumer_group), None)
    pending = int(info["pending"]) if info else 0
    lag = info.get("lag") if info else length
    if lag is None:  # Redis 6.2: entries not yet delivered = length - delivered-but-unacked
        lag = max(0, length - pending)
    return {"stream": stream, "length": length, "pending": pending, "lag": int(lag),
            "consumers": int(info["consumers"]) if info else 0}
