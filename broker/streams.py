"""The rollouts stream: producers XADD encoded groups, the learner reads them through a
consumer group, acknowledges them after the step that used them (XACK then XDEL,
pipelined) and sends what it cannot use to the dead-letter stream with the reason.

Nothing is trimmed: back-pressure makes producers wait while the stream is full.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from broker.keys import Keys

log = logging.getLogger(__name__)

PAYLOAD_FIELD = b"g"


def connect(url: str, *, blocking: bool = False) -> aioredis.Redis:
    """A binary-safe client. A client used for blocking reads gets no socket timeout
    shorter than its block time (blocking reads hold their connection)."""
    return aioredis.Redis.from_url(url, decode_responses=False,
                                   socket_timeout=None if blocking else 30.0,
                                   health_check_interval=30)


def _id(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


class RolloutProducer:
    """Pushes encoded rollout groups; waits (never drops, never trims) while the stream is full."""

    def __init__(self, client: aioredis.Redis, keys: Keys, max_len: int, poll_s: float = 0.05):
        self.client, self.keys, self.max_len, self.poll_s = client, keys, max_len, poll_s
        self.waited_s = 0.0

    async def push(self, data: bytes) -> str:
        started = time.monotonic()
        logged = False
        while await self.client.xlen(self.keys.rollouts) >= self.max_len:
            if not logged:
                log.info("rollouts stream full (%d groups): waiting for the learner", self.max_len)
                logged = True
            await asyncio.sleep(self.poll_s)
        self.waited_s += time.monotonic() - started
        return _id(await self.client.xadd(self.keys.rollouts, {PAYLOAD_FIELD: data}))


class RolloutConsumer:
    """Reads groups for one named consumer of the learner's consumer group.

    A restarted consumer first re-reads its own pending entries (id 0), then new ones (>).
    Entries whose payload was deleted come back with data None (Redis 6.2 and 7.x both
    return them from a pending read); acknowledge them like any other.
    """

    def __init__(self, client: aioredis.Redis, keys: Keys, consumer: str):
        self.client, self.keys, self.consumer = client, keys, consumer
        self._pending_done = False

    async def ensure_group(self) -> None:
        try:
            await self.client.xgroup_create(self.keys.rollouts, self.keys.consumer_group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, count: int, block_ms: int = 1000) -> list[tuple[str, bytes | None]]:
        if not self._pending_done:
            entries = await self._xreadgroup("0", count, None)
            if entries:
                return entries
            self._pending_done = True
        return await self._xreadgroup(">", count, block_ms)

    async def _xreadgroup(self, start: str, count: int, block_ms: int | None) -> list[tuple[str, bytes | None]]:
        reply = await self.client.xreadgroup(self.keys.consumer_group, self.consumer,
                                             {self.keys.rollouts: start}, count=count, block=block_ms)
        out = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                out.append((_id(entry_id), (fields or {}).get(PAYLOAD_FIELD)))
        return out

    async def ack(self, entry_ids: list[str]) -> None:
        if not entry_ids:
            return
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.xack(self.keys.rollouts, self.keys.consumer_group, *entry_ids)
            pipe.xdel(self.keys.rollouts, *entry_ids)
            await pipe.execute()

    async def dead_letter(self, entry_id: str, data: bytes | None, reason: str, detail: str = "") -> None:
        """Move an entry to the dead-letter stream with its reason, then acknowledge it."""
        log.warning("dead letter %s: %s %s", entry_id, reason, detail)
        await self.client.xadd(self.keys.dead_letters, {b"reason": reason, b"detail": detail[:1000],
                                                        b"entry": entry_id, b"data": data or b""})
        await self.ack([entry_id])
