"""The actor's side of weight updates: a gate through which generation runs on one weight
version at a time, and a receiver that watches the broker for new versions and applies
them in place, from a blob (Redis chunks or a shared file) or over the broadcast link.

An update either interrupts generation (`actor.update_mode = "interrupt"`: the engine pauses
between decode steps, running requests come back with the tokens they have, and continue on
the new weights once it is loaded) or drains it (new requests wait while running ones
finish). Calls that must run whole on one version (an evaluation) hold the gate `pinned`:
an update waits for them either way. A load that fails leaves the weights unknown: the gate
stays closed until a version loads whole."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgpack

from broker.retry import RetryPolicy
from broker.weights import Announcements, WeightStore, WeightVersionError, discard
from common.logs import first_line

log = logging.getLogger(__name__)


# The running call's "its request is in the engine" flag (a call runs in one task at a time).
_SENT: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("omrl_weight_gate_sent", default=None)


class WeightGate:
    """`pause` and `resume` (the engine's) make updates interrupt running calls; without them
    an update waits for the calls in flight to finish.

    An interrupting update pauses the engine only once every call in flight has its request
    in the engine (`sent()`, called by the engine once the request is sent): requests and the
    pause travel in order, so a request sent before the pause ran on the old weights (and is
    aborted with them), and one sent after waits for the new. Every token is then labelled
    with the version that produced it, exactly."""

    def __init__(self, version: int = 0, pause: Callable[[], Awaitable[None]] | None = None,
                 resume: Callable[[], Awaitable[None]] | None = None):
        self.version = version
        self.applied = 0
        self.failed = 0  # loads that failed
        self._pause, self._resume = pause, resume
        self._in_flight = 0
        self._pinned = 0
        self._all_sent = asyncio.Event()  # set while every unpinned call in flight has its request sent
        self._all_sent.set()
        self._unsent = 0
        self._updating = False
        self._broken = False  # a load failed part-way: nothing may generate until one succeeds
        self._cond = asyncio.Condition()
        self._busy_s = 0.0  # seconds with at least one generate call in flight, up to _busy_since
        self._busy_since = 0.0
        self.update_s = 0.0  # seconds updates held generation back (wait for calls, load, resume)
        self.blocked_s = 0.0  # seconds generate calls waited at the gate, summed over calls

    @property
    def broken(self) -> bool:
        """A load failed part-way: the engine's weights are unknown until a version loads whole."""
        return self._broken

    @property
    def generating_s(self) -> float:
        """Seconds so far during which at least one generate call was in flight (the engine was
        busy): the rest of an actor's time its engine was idle."""
        return self._busy_s + (time.monotonic() - self._busy_since if self._in_flight else 0.0)

    @contextlib.asynccontextmanager
    async def generating(self, pinned: bool = False) -> AsyncIterator[int]:
        """Hold while a generate call runs; yields the weight version it runs on. An update may
        interrupt the call (it returns early, finish reason "abort") unless `pinned`."""
        async with self._cond:
            waited = time.monotonic()
            await self._cond.wait_for(lambda: not self._updating and not self._broken)
            self.blocked_s += time.monotonic() - waited
            if not self._in_flight:
                self._busy_since = time.monotonic()
            self._in_flight += 1
            self._pinned += pinned
            flag = [pinned]  # pinned calls are waited for whole: no need to know when they are sent
            if not pinned:
                self._unsent += 1
                self._all_sent.clear()
        token = _SENT.set(flag)
        try:
            yield self.version
        finally:
            _SENT.reset(token)
            self._mark_sent(flag)
            async with self._cond:
                self._in_flight -= 1
                self._pinned -= pinned
                if not self._in_flight:
                    self._busy_s += time.monotonic() - self._busy_since
                self._cond.notify_all()

    def sent(self) -> None:
        """The running call's request is in the engine (the engine calls this)."""
        flag = _SENT.get()
        if flag is not None:
            self._mark_sent(flag)

    def _mark_sent(self, flag: list[bool]) -> None:
        if not flag[0]:
            flag[0] = True
            self._unsent -= 1
            if not self._unsent:
                self._all_sent.set()

    async def apply(self, version: int, load: Callable[[], Awaitable[int | None]]) -> None:
        """Stop new generate calls, interrupt (or wait for) those in flight, load, then resume.
        `load` may return the version it loaded (broadcast: the learner's newest)."""
        started = time.monotonic()
        interrupt = self._pause is not None
        async with self._cond:
            self._updating = True
            await self._cond.wait_for(lambda: (self._pinned if interrupt else self._in_flight) == 0)
        try:
            if interrupt:
                await self._all_sent.wait()  # no new call enters meanwhile: only the sending ones
                await self._pause()
            try:
                loaded = await load()
            except BaseException:
                self._broken, self.failed = True, self.failed + 1
                raise
            finally:
                if interrupt:
                    await self._resume()
            self._broken = False
            self.version = version if loaded is None else loaded
            self.applied += 1
        finally:
            async with self._cond:
                self._updating = False
                self.update_s += time.monotonic() - started
                self._cond.notify_all()


class BroadcastLink:
    """The actor's end of the broadcast transport: joins the learner named in the version's
    record (again after a failure or a learner restart), then receives each version straight
    into the engine's workers."""

    def __init__(self, engine, name: str, timeout_s: float):
        self.engine, self.name, self.timeout_s = engine, name, timeout_s
        self.address: str | None = None  # the learner's, while joined
        self.store = self.link = None

    async def join(self, record: dict) -> None:
        """Join the learner the record names, unless joined to it already."""
        if self.address != _learner(record):
            await self._join(record)

    async def receive(self, record: dict) -> int:
        try:
            await asyncio.to_thread(self.store.set, f"{self.link}/want", b"1")
            return await self.engine.receive_weights()
        except BaseException:
            self.address = None  # the group is gone on one side or the other: join again next time
            raise

    async def _join(self, record: dict) -> None:
        from common.weight_sync import open_store

        host, port = record["address"].rsplit(":", 1)
        self.address = None
        self.store = await asyncio.to_thread(open_store, host, int(port), self.timeout_s)
        number = await asyncio.to_thread(self.store.add, "joins", 1) - 1
        self.link = f"link/{number}"
        await asyncio.to_thread(self.store.set, f"join/{number}",
                                msgpack.packb({"name": self.name, "world": 1 + self.engine.workers}))
        await self.engine.join_weights(host, int(port), self.link, record["backend"], self.timeout_s)
        self.address = _learner(record)
        log.info("joined the learner's weight group at %s (%s)", self.address, self.link)


def _learner(record: dict) -> str:
    """Which learner process sends a broadcast version: its address and session."""
    return f"{record['address']}/{record.get('session', '')}"


async def apply_newest(store: WeightStore, gate: WeightGate, load_path: Callable[[str], Awaitable[None]],
                       directory: str, retry: RetryPolicy = RetryPolicy(), link: BroadcastLink | None = None) -> bool:
    """Fetch, verify and apply the newest version if it is newer than the one in use.
    A version rotated out (or failing its checksum) between reading the record and fetching
    the bytes is skipped with a warning: the next call reads the record again, and so
    fetches the newest. True if a version was applied."""
    record = await retry.run("read the weight version", store.latest)
    if record is None or (record["version"] <= gate.version and not gate.broken):
        return False
    if record["transport"] == "broadcast":
        if link is None:
            raise WeightVersionError("weights travel by broadcast, and this receiver has no broadcast link")
        await link.join(record)  # before the gate closes: a failed join leaves the weights as they are
        await gate.apply(record["version"], lambda: link.receive(record))
        log.info("applied weight version %d by broadcast (%d bytes)", gate.version, record["nbytes"])
        return True
    try:
        path = await retry.run("fetch weights", lambda: store.fetch_to(record, directory))
    except WeightVersionError as exc:
        log.warning("%s: fetching the newest version instead", exc)
        return False
    try:
        await gate.apply(record["version"], lambda: load_path(path))
    finally:
        discard(record, path)
    log.info("applied weight version %d (step %d, %d bytes)", record["version"], record["step"], record["nbytes"])
    return True


async def receive_weights(store: WeightStore, gate: WeightGate, load_path: Callable[[str], Awaitable[None]],
                          poll_s: float, stop: asyncio.Event, retry: RetryPolicy = RetryPolicy(),
                          link: BroadcastLink | None = None) -> None:
    """Apply each newer version: woken by its announcement, or at the latest after poll_s. A
    version that fails to load is logged and tried again (the newest) at the next wake-up."""
    announcements = Announcements(store.client, store.keys)
    try:
        with tempfile.TemporaryDirectory(prefix="omrl-weights-") as tmp:
            while not stop.is_set():
                try:
                    if await apply_newest(store, gate, load_path, tmp, retry, link):
                        continue  # a newer one may be out already
                except Exception as exc:  # noqa: BLE001 - the next version, or the same again, may load
                    log.error("weight update failed: %s: %s%s", type(exc).__name__, first_line(exc),
                              " (generation waits until a version loads whole)" if gate.broken else "")
                waits = [asyncio.ensure_future(announcements.wait(poll_s)), asyncio.ensure_future(stop.wait())]
                _done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in pending:  # only the stop interrupts an announcement's wait
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await announcements.close()
