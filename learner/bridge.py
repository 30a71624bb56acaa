"""The single bridge thread between the asyncio broker and the synchronous learner.

On its own event loop it runs one reader per rollout stream (shard), feeding a bounded
queue; a janitor that claims entries idle too long that nobody works on (those of dead
consumers, and own ones a lost reply delivered unseen), removes consumers that are gone,
reports dead actors and forgets long-dead ones; and the learner's broker calls
(ack, publish, dead letters, filtered groups), which the learner thread submits with `call`. Undecodable
or invalid messages, and entries delivered more than `max_deliveries` times, go to the
dead letters with their reason; the readers keep running. Connection faults are retried
by a declared policy (a Redis restart is survived); other errors stop the bridge and are
re-raised in the learner thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ResponseError

from broker.admission import wake_waiting
from broker.connection import connect
from broker.evals import last_eval_id, read_evals
from broker.keys import Keys
from broker.membership import Membership
from broker.retry import RetryPolicy
from broker.streams import Entry, RolloutConsumer
from broker.weights import WeightStore
from common.config import RedisConfig
from common.messages import CodecError, RolloutGroup, decode_group

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass
class Delivery:
    shard: int
    entry_id: str
    data: bytes
    group: RolloutGroup

    @property
    def key(self) -> tuple[int, str]:
        return (self.shard, self.entry_id)


class BrokerBridge:
    def __init__(self, cfg: RedisConfig, consumer: str, keep_versions: int, queue_size: int, read_count: int,
                 chunk_bytes: int = 64 << 20, weights_dir: str | None = None, admission: tuple[int, int] | None = None):
        self.cfg = cfg
        self.admission = admission  # (groups per step, eta): the janitor rings the tickets' doorbell
        self.keys = Keys(cfg.run, cfg.shards)
        self.queue: queue.Queue[Delivery] = queue.Queue(maxsize=queue_size)
        self.read_count = read_count
        self.retry = RetryPolicy(attempts=cfg.retry_attempts)
        self.client = connect(cfg)
        self.consumers = [RolloutConsumer(self.client, self.keys, consumer, shard, cfg.max_stream_len)
                          for shard in range(cfg.shards)]
        self.store = WeightStore(self.client, self.keys, keep=keep_versions, chunk_bytes=chunk_bytes,
                                 directory=weights_dir)
        self.members = Membership(self.client, self.keys)
        self.dead_letters: dict[str, int] = {}
        self.filtered: dict[str, int] = {}  # learner.filter_groups: groups taken out untrained, by reason
        self.in_flight: set[tuple[int, str]] = set()
        self.reported_dead: set[str] = set()
        self.evals: list[dict] = []  # evaluation results not yet in a step record
        self._evals_after = "0"
        self._loop = asyncio.new_event_loop()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="broker-bridge", daemon=True)

    # -- learner-thread side -------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> BrokerBridge:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("broker bridge did not connect to Redis in time")
        self.check()
        return self

    def check(self) -> None:
        """Re-raise in the caller's thread an error that stopped the bridge."""
        if self._error is not None:
            raise RuntimeError("broker bridge failed") from self._error

    def call(self, factory: Callable[[], Awaitable[T]], what: str = "broker call", timeout: float = 600.0) -> T:
        """Run `factory()` on the bridge's loop, retried on connection faults, and wait for it."""
        self.check()
        return asyncio.run_coroutine_threadsafe(self.retry.run(what, factory), self._loop).result(timeout)

    def get(self, timeout: float) -> Delivery | None:
        self.check()
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def ack(self, deliveries: list[Delivery]) -> None:
        self.call(lambda: self._ack(deliveries), "XACK")

    def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        self.call(lambda: self._dead_letter(delivery.shard, delivery.entry_id, delivery.data, reason, detail),
                  "dead letter")

    def filter(self, delivery: Delivery, reason: str) -> None:
        """Take the group out untrained (learner.filter_groups), counted as filtered."""
        self.call(lambda: self._filter(delivery.shard, delivery.entry_id, reason), "filter")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # -- bridge-thread side --------------------------------------------------------------
    async def _ack(self, deliveries: list[Delivery]) -> None:
        by_shard: dict[int, list[str]] = {}
        for d in deliveries:
            by_shard.setdefault(d.shard, []).append(d.entry_id)
        for shard, ids in by_shard.items():
            await self.consumers[shard].ack(ids)
        self.in_flight.difference_update(d.key for d in deliveries)

    async def _dead_letter(self, shard: int, entry_id: str, data: bytes | None, reason: str, detail: str) -> None:
        await self.retry.run("dead letter", lambda: self.consumers[shard].dead_letter(entry_id, data, reason, detail,
                                                                                   self.cfg.dead_letter_max))
        self.dead_letters[reason] = self.dead_letters.get(reason, 0) + 1
        self.in_flight.discard((shard, entry_id))

    async def _filter(self, shard: int, entry_id: str, reason: str) -> None:
        await self.consumers[shard].filter(entry_id, reason)
        self.filtered[reason] = self.filtered.get(reason, 0) + 1
        self.in_flight.discard((shard, entry_id))

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except Exception as exc:  # noqa: BLE001 - surfaced to the learner thread by check()
            log.exception("broker bridge failed")
            self._error = exc
            self._ready.set()
        finally:
            self._loop.run_until_complete(self.client.aclose())

    async def _main(self) -> None:
        for consumer in self.consumers:
            await self.retry.run("XGROUP CREATE", consumer.ensure_group)
        self._evals_after = await self.retry.run("read evaluations", lambda: last_eval_id(self.client, self.keys))
        self._ready.set()
        tasks = [asyncio.create_task(self._reader(c)) for c in self.consumers]
        tasks.append(asyncio.create_task(self._janitor()))
        try:
            while not self._stop.is_set():
                for t in tasks:
                    if t.done():
                        t.result()  # re-raise a reader's or the janitor's error
                await asyncio.sleep(0.1)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _reader(self, consumer: RolloutConsumer) -> None:
        while not self._stop.is_set():
            try:
                entries = await self.retry.run("XREADGROUP", lambda: consumer.read(self.read_count, block_ms=500))
            except ResponseError as exc:
                if not _stream_gone(exc):
                    raise
                log.warning("consumer group of %s is gone (Redis lost its data?): creating it again", consumer.stream)
                await consumer.ensure_group()
                continue
            await self._handle(consumer, entries)

    async def _handle(self, consumer: RolloutConsumer, entries: list[Entry]) -> None:
        # Every entry of the read is held before the first await, not one by one as the queue
        # takes them: one waiting for room in a full queue longer than claim_idle_s would look
        # idle to the janitor, which claimed it (a delivery more; after two restarts a good
        # group went to the dead letters as max_deliveries). Already held: being handled,
        # queued or in a step (the janitor and a reader may hold the same entry).
        entries = [e for e in entries if (consumer.shard, e.id) not in self.in_flight]
        self.in_flight.update((consumer.shard, e.id) for e in entries)
        for entry in entries:
            key = (consumer.shard, entry.id)
            if entry.data is None:  # payload deleted after an earlier delivery
                await self.retry.run("XACK", lambda: consumer.ack([entry.id]))
                self.in_flight.discard(key)
                continue
            if entry.deliveries > self.cfg.max_deliveries:
                await self._dead_letter(consumer.shard, entry.id, entry.data, "max_deliveries",
                                        f"delivered {entry.deliveries} times")
                continue
            try:
                group = decode_group(entry.data)
            except CodecError as exc:
                await self._dead_letter(consumer.shard, entry.id, entry.data, exc.reason, str(exc))
                continue
            while not self._stop.is_set():
                try:
                    self.queue.put_nowait(Delivery(consumer.shard, entry.id, entry.data, group))
                    break
                except queue.Full:
                    await asyncio.sleep(0.01)

    async def _janitor(self) -> None:
        cfg = self.cfg
        while not self._stop.is_set():
            await asyncio.sleep(cfg.janitor_every_s)
            for consumer in self.consumers:
                try:
                    await self._tidy(consumer)
                except ResponseError as exc:
                    if not _stream_gone(exc):
                        raise  # else Redis lost its data: the reader creates the group again
            await self._watch_members()
            await self._ring_doorbells()
            records, self._evals_after = await self.retry.run(
                "read evaluations", lambda: read_evals(self.client, self.keys, self._evals_after))
            self.evals.extend(records)

    async def _ring_doorbells(self) -> None:
        """Ring the doorbells for the room there is now (tickets, each stream's space): heals a
        ring that was lost, and wakes the groups that expired tickets let in, within a janitor
        round instead of the waiters' fallback."""
        if self.admission is not None:
            await self.retry.run("ring the tickets' doorbell",
                                 lambda: wake_waiting(self.client, self.keys, *self.admission))
        for consumer in self.consumers:
            await self.retry.run("ring a stream's doorbell", consumer.ring_room)

    async def _tidy(self, consumer: RolloutConsumer) -> None:
        cfg = self.cfg
        held = {entry_id for shard, entry_id in self.in_flight if shard == consumer.shard}
        claimed = await self.retry.run("XPENDING/XCLAIM", lambda: consumer.claim_idle(int(cfg.claim_idle_s * 1000), held))
        if claimed:
            log.info("claimed %d entries idle over %gs on %s", len(claimed), cfg.claim_idle_s, consumer.stream)
        await self._handle(consumer, claimed)
        gone = await self.retry.run("XINFO CONSUMERS",
                                    lambda: consumer.remove_gone_consumers(int(cfg.consumer_gone_s * 1000)))
        for name in gone:
            log.info("removed consumer %s of %s (gone)", name, consumer.stream)

    async def _watch_members(self) -> None:
        """Report actors that went silent; forget those silent for longer than consumer_gone_s."""
        cfg = self.cfg
        for member in await self.retry.run("read members", lambda: self.members.members(cfg.dead_after_s)):
            if member["alive"]:
                self.reported_dead.discard(member["id"])
            elif member["silent_s"] > cfg.consumer_gone_s:
                await self.retry.run("forget member", lambda: self.members.leave(member["id"]))
                self.reported_dead.discard(member["id"])
            elif member["id"] not in self.reported_dead:
                self.reported_dead.add(member["id"])
                log.warning("%s %s is dead: no heartbeat for %.0fs (host %s, version %s)", member.get("role", "actor"),
                            member["id"], member["silent_s"], member.get("host"), member.get("version"))


def _stream_gone(exc: ResponseError) -> bool:
    """The stream or its consumer group no longer exists (a Redis that lost its data):
    NOGROUP, or UNBLOCKED for a read that was blocked on the deleted key (Redis 7)."""
    return str(exc).startswith(("NOGROUP", "UNBLOCKED"))
