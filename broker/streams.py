"""The rollouts streams: producers XADD encoded groups, the learner reads them through a
consumer group, acknowledges them after the step that used them is committed (XACK then
XDEL, pipelined), and sends what it cannot use to the dead-letter stream with the reason.

Nothing is trimmed: back-pressure makes producers wait while a stream is full. Producers
keep a bounded local buffer and retry by a declared policy while Redis is unreachable.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from broker.keys import Keys
from broker.retry import RetryPolicy

log = logging.getLogger(__name__)

PAYLOAD_FIELD = b"g"


def _id(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


class RolloutProducer:
    """Pushes encoded rollout groups, round-robin over the run's streams.

    `push` puts the group in a bounded local buffer (waiting while it is full); a flusher
    task writes it to Redis, waiting while the stream is full and retrying by `retry`
    while Redis is unreachable. A retried XADD whose reply was lost can write a group
    twice; the learner de-duplicates by group id.
    """

    def __init__(self, client: aioredis.Redis, keys: Keys, max_len: int, buffer_size: int = 64,
                 retry: RetryPolicy = RetryPolicy(), poll_s: float = 0.05):
        self.client, self.keys, self.max_len, self.poll_s, self.retry = client, keys, max_len, poll_s, retry
        self._buffer: asyncio.Queue[bytes] = asyncio.Queue(buffer_size)
        self._shards = itertools.cycle(range(keys.shards))
        self.waited_s = 0.0

    async def push(self, data: bytes) -> None:
        await self._buffer.put(data)

    @property
    def buffered(self) -> int:
        return self._buffer.qsize()

    async def flush(self) -> None:
        """Wait until every buffered group is in Redis."""
        await self._buffer.join()

    async def run(self) -> None:
        """The flusher: runs until cancelled."""
        while True:
            data = await self._buffer.get()
            stream = self.keys.rollouts(next(self._shards))
            await self.retry.run("XADD to the rollouts stream", lambda: self._add(stream, data))
            self._buffer.task_done()

    async def _add(self, stream: str, data: bytes) -> str:
        started = time.monotonic()
        logged = False
        while await self.client.xlen(stream) >= self.max_len:
            if not logged:
                log.info("rollouts stream %s full (%d groups): waiting for the learner", stream, self.max_len)
                logged = True
            await asyncio.sleep(self.poll_s)
        self.waited_s += time.monotonic() - started
        return _id(await self.client.xadd(stream, {PAYLOAD_FIELD: data}))


class RolloutConsumer:
    """Reads one stream for one named consumer of the learner's consumer group.

    A (re)started consumer first re-reads its own pending entries (id 0), then new ones
    (>). An entry whose payload was deleted comes back with data None: acknowledge it.
    """

    def __init__(self, client: aioredis.Redis, keys: Keys, consumer: str, shard: int = 0):
        self.client, self.keys, self.consumer, self.shard = client, keys, consumer, shard
        self.stream = keys.rollouts(shard)
        self.group = keys.consumer_group
        self.reading_pending = True

    async def ensure_group(self) -> None:
        try:
            await self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, count: int, block_ms: int = 1000) -> list[tuple[str, bytes | None]]:
        """Own pending entries first (sets `reading_pending`), then new ones."""
        if self.reading_pending:
            entries = await self._xreadgroup("0", count, None)
            if entries:
                return entries
            self.reading_pending = False
        return await self._xreadgroup(">", count, block_ms)

    async def _xreadgroup(self, start: str, count: int, block_ms: int | None) -> list[tuple[str, bytes | None]]:
        reply = await self.client.xreadgroup(self.group, self.consumer, {self.stream: start}, count=count, block=block_ms)
        return [(_id(entry_id), (fields or {}).get(PAYLOAD_FIELD))
                for _stream, entries in (reply or []) for entry_id, fields in entries]

    async def ack(self, entry_ids: list[str]) -> None:
        if not entry_ids:
            return
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.xack(self.stream, self.group, *entry_ids)
            pipe.xdel(self.stream, *entry_ids)
            await pipe.execute()

    async def dead_letter(self, entry_id: str, data: bytes | None, reason: str, detail: str = "") -> None:
        """Move an entry to the dead-letter stream with its reason, then acknowledge it."""
        log.warning("dead letter %s %s: %s %s", self.stream, entry_id, reason, detail)
        await self.client.xadd(self.keys.dead_letters, {b"reason": reason, b"detail": detail[:1000], b"stream": self.stream,
                                                        b"entry": entry_id, b"data": data or b""})
        await self.ack([entry_id])

    async def claim_idle(self, min_idle_ms: int, count: int = 100) -> list[tuple[str, bytes | None]]:
        """XAUTOCLAIM every entry idle longer than `min_idle_ms` (from dead consumers) to this
        consumer. Accepts both reply shapes: Redis 7 adds a list of deleted ids (already
        dropped from the pending list); Redis 6.2 returns a deleted entry as (None, None)
        and keeps it pending, so the next read() re-reads own pending entries, where it
        comes back as (id, None) to be acknowledged."""
        out, cursor = [], "0-0"
        while True:
            reply = await self.client.xautoclaim(self.stream, self.group, self.consumer, min_idle_ms,
                                                 start_id=cursor, count=count)
            cursor, entries = _id(reply[0]), reply[1]
            for entry_id, fields in entries:
                if entry_id is None:  # Redis 6.2: a deleted entry, id not given
                    self.reading_pending = True
                else:
                    out.append((_id(entry_id), (fields or {}).get(PAYLOAD_FIELD)))
            if cursor == "0-0":
                return out

    async def delivery_count(self, entry_id: str) -> int:
        rows = await self.client.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        return int(rows[0]["times_delivered"]) if rows else 0

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
