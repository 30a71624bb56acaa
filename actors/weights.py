"""The actor's side of weight updates: a gate that lets generation run while no update is
being applied, so every generate call runs on exactly one weight version, and a receiver
that watches the broker for new versions and applies them in place."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from typing import AsyncIterator, Awaitable, Callable

from broker.retry import RetryPolicy
from broker.weights import Announcements, WeightStore, WeightVersionError

log = logging.getLogger(__name__)


class WeightGate:
    def __init__(self, version: int = 0):
        self.version = version
        self.applied = 0
        self._in_flight = 0
        self._updating = False
        self._cond = asyncio.Condition()
        self._busy_s = 0.0  # seconds with at least one generate call in flight, up to _busy_since
        self._busy_since = 0.0

    @property
    def generating_s(self) -> float:
        """Seconds so far during which at least one generate call was in flight (the engine was
        busy): the rest of an actor's time its engine was idle."""
        return self._busy_s + (time.monotonic() - self._busy_since if self._in_flight else 0.0)

    @contextlib.asynccontextmanager
    async def generating(self) -> AsyncIterator[int]:
        """Hold while a generate call runs; yields the weight version it runs on."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._updating)
            if not self._in_flight:
                self._busy_since = time.monotonic()
            self._in_flight += 1
        try:
            yield self.version
        finally:
            async with self._cond:
                self._in_flight -= 1
                if not self._in_flight:
                    self._busy_s += time.monotonic() - self._busy_since
                self._cond.notify_all()

    async def apply(self, version: int, load: Callable[[], Awaitable[None]]) -> None:
        """Stop new generate calls, wait for those in flight, load, then resume."""
        async with self._cond:
            self._updating = True
            await self._cond.wait_for(lambda: self._in_flight == 0)
        try:
            await load()
            self.version = version
            self.applied += 1
        finally:
            async with self._cond:
                self._updating = False
                self._cond.notify_all()


async def apply_newest(store: WeightStore, gate: WeightGate, load_path: Callable[[str], Awaitable[None]],
                       directory: str, retry: RetryPolicy = RetryPolicy()) -> bool:
    """Fetch, verify and apply the newest version if it is newer than the one in use.
    A version rotated out (or failing its checksum) between reading the record and fetching
    the bytes is skipped with a warning: the next call reads the record again, and so
    fetches the newest. True if a version was applied."""
    record = await retry.run("read the weight version", store.latest)
    if record is None or record["version"] <= gate.version:
        return False
    try:
        blob = await retry.run("fetch weights", lambda: store.fetch(record))
    except WeightVersionError as exc:
        log.warning("%s: fetching the newest version instead", exc)
        return False
    path = os.path.join(directory, f"v{record['version']}.safetensors")
    with open(path, "wb") as f:
        f.write(blob)
    try:
        await gate.apply(record["version"], lambda: load_path(path))
    finally:
        os.unlink(path)
    log.info("applied weight version %d (step %d, %d bytes)", record["version"], record["step"], record["nbytes"])
    return True


async def receive_weights(store: WeightStore, gate: WeightGate, load_path: Callable[[str], Awaitable[None]],
                          poll_s: float, stop: asyncio.Event, retry: RetryPolicy = RetryPolicy()) -> None:
    """Apply each newer version: woken by its announcement, or at the latest after poll_s."""
    announcements = Announcements(store.client, store.keys)
    try:
        with tempfile.TemporaryDirectory(prefix="omrl-weights-") as tmp:
            while not stop.is_set():
                if await apply_newest(store, gate, load_path, tmp, retry):
                    continue  # a newer one may be out already
                waits = [asyncio.ensure_future(announcements.wait(poll_s)), asyncio.ensure_future(stop.wait())]
                _done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in pending:  # only the stop interrupts an announcement's wait
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await announcements.close()
