"""The actor's side of weight updates: a gate through which generation runs on one weight
version at a time, and a receiver that watches the broker for new versions and applies
them in place, from a blob (Redis chunks or a shared file) or over the broadcast link.

An update either interrupts generation (`actor.update_mode = "interrupt"`: the engine pauses
between decode steps, running requests come back with the tokens they have, and continue on
the new weights once it is loaded), keeps it ("keep": the engine pauses with the running
requests and their KV cache kept, and they go on on the new weights) or drains it (new
requests wait while running ones finish). Calls that must run whole on one version (an evaluation) hold the gate `pinned`:
an update waits for them either way. A load that fails leaves the weights unknown: the gate
stays closed until a version loads whole."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import msgpack

from broker.retry import RetryPolicy
from broker.weights import Announcements, WeightStore, WeightVersionError, discard
from common.logs import first_line
from common.retry import wait_set
from common.weight_sync import (
    HEARTBEAT_S,
    JOINS,
    LEAVES,
    LOCAL_FAILURE,
    POLL_S,
    SENDS,
    alive_key,
    dropped_key,
    epoch_key,
    join_key,
    leave_key,
    send_key,
)

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
    with the version that produced it, exactly. A pause that keeps the requests (keep mode)
    goes the same way; a kept request's tokens after the swap are the new version's, which
    `versions_since` names (the engine counts where each swap fell: `Generation.swaps`)."""

    HISTORY = 256  # versions applied that `versions_since` remembers

    def __init__(self, version: int = 0, pause: Callable[[], Awaitable[None]] | None = None,
                 resume: Callable[[], Awaitable[None]] | None = None):
        self.version = version
        self.applied = 0
        self._history: collections.deque[int] = collections.deque(maxlen=self.HISTORY)  # the last versions applied
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
        self._progress_at = time.monotonic()  # the engine's last finished work (a call, an update), or idle's end
        self.update_s = 0.0  # seconds updates held generation back (wait for calls, load, resume)
        self.blocked_s = 0.0  # seconds generate calls waited at the gate, summed over calls

    @property
    def broken(self) -> bool:
        """A load failed part-way: the engine's weights are unknown until a version loads whole."""
        return self._broken

    def stalled_s(self) -> float:
        """Seconds the engine has had work (a generate call in flight, or an update under way)
        without finishing any of it; 0 while it is idle. What an actor's liveness reads: a wedged
        engine finishes nothing while the event loop goes on."""
        return time.monotonic() - self._progress_at if self._in_flight or self._updating else 0.0

    def _work_starts(self) -> None:
        if not self._in_flight and not self._updating:  # idle until now: the stall counts from here
            self._progress_at = time.monotonic()

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
            self._work_starts()
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
                self._progress_at = time.monotonic()
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

    def versions_since(self, applied: int, count: int) -> list[int]:
        """The versions of the `count` updates applied after the first `applied` (a call read
        `applied` as it began; the updates it ran through, kept, in order)."""
        first = self.applied - len(self._history)  # the number of the oldest update remembered, less one
        if count and applied < first:
            raise RuntimeError(f"a call ran through more than {self.HISTORY} updates: their versions are forgotten")
        return list(self._history)[applied - first:applied - first + count]

    async def apply(self, version: int, load: Callable[[], Awaitable[int | None]]) -> None:
        """Stop new generate calls, interrupt (or wait for) those in flight, load, then resume.
        `load` may return the version it loaded (broadcast: the learner's newest)."""
        started = time.monotonic()
        interrupt = self._pause is not None
        async with self._cond:
            self._work_starts()
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
            self._history.append(self.version)
        finally:
            async with self._cond:
                self._updating = False
                self._progress_at = time.monotonic()
                self.update_s += time.monotonic() - started
                self._cond.notify_all()


def update_gate(mode: str, engine) -> WeightGate:
    """The gate of actor.update_mode for `engine` (one without a pause drains)."""
    if mode == "drain" or not hasattr(engine, "pause"):
        return WeightGate(0)
    return WeightGate(0, pause=functools.partial(engine.pause, keep=mode == "keep"), resume=engine.resume)


class BroadcastLink:
    """The actor's end of the broadcast transport: a member of the learner's one weight group
    (joined again after a learner restart or a drop). A thread of its own relays each version
    down the chain as it arrives and stages it as a safetensors file in `directory`, whatever
    the engine is doing; the gate then loads the staged file as it loads a blob version, so an
    actor busy generating (or holding an evaluation) delays no other actor's weights."""

    def __init__(self, name: str, directory: str, timeout_s: float):
        self.name, self.directory, self.timeout_s = name, directory, timeout_s
        self.address: str | None = None  # the learner's, while a member
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._staged: tuple[int, str] | None = None  # the newest version staged from this learner, and its file
        self._staging = threading.Lock()  # around `_staged`: a member thread of a learner left may still end
        self._arrived: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def join(self, record: dict) -> None:
        """Become a member of the learner the record names, unless one already."""
        if self.address == _learner(record):
            return
        await asyncio.to_thread(self.close)
        with self._staging:  # another learner (a restart): its numbers say nothing of the one left
            self._unstage()
        self._loop, self._arrived, self._stop = asyncio.get_running_loop(), asyncio.Event(), threading.Event()
        host, port = record["address"].rsplit(":", 1)
        self._thread = threading.Thread(target=self._member, args=(host, int(port), self._stop),
                                        name="weights-member", daemon=True)
        self._thread.start()
        self.address = _learner(record)

    async def receive(self, record: dict) -> tuple[int, str]:
        """The newest version staged once it is the record's or newer, and a link to its file of
        the caller's own (to `discard` once loaded). Fails after timeout_s, naming the learner;
        the engine's weights are untouched."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            staged = self._staged
            if staged is not None and staged[0] >= record["version"]:
                with contextlib.suppress(FileNotFoundError):  # a newer one replaced it meanwhile: take that
                    mine = f"{staged[1]}.{uuid.uuid4().hex}"
                    os.link(staged[1], mine)
                    return staged[0], mine
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightVersionError(f"version {record['version']} did not arrive from the learner at "
                                         f"{record['address']} within weights.timeout_s ({self.timeout_s:g}s)")
            await wait_set(self._arrived, min(left, 1.0))
            self._arrived.clear()  # before the next look at `_staged`: a version staged meanwhile sets it again

    def close(self, wait_s: float = 2.0) -> None:
        """Leave the learner's group: the thread says so to the learner and ends (waited for up
        to wait_s; in the middle of a send it ends after it)."""
        if self._stop is not None:
            self._stop.set()
            self._thread.join(wait_s)
        self.address = None

    def _stage(self, version: int, path: str, stop: threading.Event) -> None:
        """`path` holds `version`: the newest staged, unless a newer one is, or this thread's
        learner was left meanwhile (then the file goes)."""
        with self._staging:
            if stop.is_set() or (self._staged is not None and self._staged[0] >= version):
                os.unlink(path)
                return
            self._unstage()
            self._staged = (version, path)
        with contextlib.suppress(RuntimeError):  # the event loop is closed: the actor is stopping
            self._loop.call_soon_threadsafe(self._arrived.set)

    def _unstage(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged[1])  # a loader holds its own link

    def _member(self, host: str, port: int, stop: threading.Event) -> None:
        """The member's thread: join, beat, and take part in every send that names it, until
        `stop` (then leave); joined again when the learner dropped it or the store failed."""
        from common.weight_sync import open_store

        while not stop.is_set():
            try:
                store = open_store(host, port, self.timeout_s)
                first = store.add(SENDS, 0)  # sends before this one were planned without us
                number = store.add(JOINS, 1) - 1
                store.set(join_key(number), msgpack.packb({"name": self.name}))  # at once: the learner reads in order
                log.info("joined the learner's weight group at %s:%d (member %d)", host, port, number)
                beating = threading.Event()
                threading.Thread(target=_beat, args=(host, port, self.timeout_s, number, beating), daemon=True,
                                 name="weights-heartbeat").start()
                try:
                    self._take_part(store, number, first, stop)
                finally:
                    beating.set()
                if stop.is_set():
                    store.set(leave_key(store.add(LEAVES, 1) - 1), str(number).encode())
            except Exception as exc:  # noqa: BLE001 - the learner is gone or restarting: join again
                log.warning("weight group at %s:%d: %s (joining again)", host, port, first_line(exc))
                stop.wait(1.0)

    def _take_part(self, store, number: int, k: int, stop: threading.Event) -> None:
        """Every send from k on: relay and stage the ones that name this member; return once the
        learner dropped it (to join again) or on `stop`."""
        import torch

        from common.weight_sync import open_group, relay_version

        epoch, group = None, None
        while not stop.is_set():
            if store.check([dropped_key(number)]):  # silent too long, or failing: join again
                log.warning("the learner dropped this actor from its weight group (%s): joining again",
                            store.get(dropped_key(number)).decode())
                return
            if not _until(store, send_key(k), 1.0, stop):
                continue
            plan = msgpack.unpackb(store.get(send_key(k)))
            this, k = k, k + 1
            if number not in plan["members"]:
                continue  # planned before this member joined (the next send names it), or it was dropped
            rank, world = 1 + plan["members"].index(number), 1 + len(plan["members"])
            try:
                if plan["epoch"] != epoch:
                    epoch, group = None, None
                    store.set(epoch_key(plan["epoch"], "ready", number), b"1")
                    if not _until(store, epoch_key(plan["epoch"], "go"), self.timeout_s, stop):
                        raise TimeoutError(f"no word from the learner on weight group {plan['epoch']} within "
                                           f"{self.timeout_s:g}s")
                    if store.get(epoch_key(plan["epoch"], "go")) != b"1":
                        continue  # given up: a member never came
                    group = open_group(store, plan["epoch"], rank, world, self.timeout_s)
                    epoch = plan["epoch"]
                version, layout, tensors = relay_version(group, rank, world)
                staged = self._staged
                if staged is None or version > staged[0]:
                    path = os.path.join(self.directory, f"broadcast-v{version}.safetensors")
                    _write_relayed(path, [(name, shape, getattr(torch, dtype)) for name, dtype, shape in layout],
                                   tensors)
                    self._stage(version, path, stop)
                else:
                    collections.deque(tensors, maxlen=0)  # passed on only: this member has it
                store.set(send_key(this, "got", number), b"1")
            except _StagingError as exc:  # relayed whole, not kept here: the group stands
                log.warning("weight send %d: %s", this, first_line(exc))
                store.set(send_key(this, "failed", number), LOCAL_FAILURE)
            except Exception as exc:  # noqa: BLE001 - a peer died or hung: the next send builds a new group
                log.warning("weight send %d failed here: %s", this, first_line(exc))
                epoch, group = None, None
                store.set(send_key(this, "failed", number), b"chain")
            store.add(send_key(this, "done"), 1)


class _StagingError(RuntimeError):
    """The version came down the chain whole but could not be written here (a full disk)."""


def _write_relayed(path: str, layout: list, tensors) -> None:
    """The relayed tensors into a safetensors file at `path`. If writing fails here, every
    bucket is still taken from the chain (the members after this one wait for each), the
    partial file goes and `_StagingError` says why; a failure of the chain itself (the
    generator raising) goes up as it is."""
    import inspect

    from common.models import write_safetensors

    try:
        write_safetensors(path, layout, tensors)
    except Exception as exc:
        with contextlib.suppress(OSError):  # never written, or not even a place to write
            os.unlink(path)
        if inspect.getgeneratorstate(tensors) == inspect.GEN_CLOSED:
            raise  # the chain failed: the generator raised
        collections.deque(tensors, maxlen=0)
        raise _StagingError(f"the version could not be staged in {path} ({first_line(exc)}); relayed all the same") \
            from exc


def _until(store, key: str, timeout_s: float, stop: threading.Event) -> bool:
    """Whether `key` is in the store within timeout_s (polled: the store's own wait logs a
    warning each time it times out)."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline or stop.wait(POLL_S):
            return False
    return True


def _beat(host: str, port: int, timeout_s: float, number: int, stop: threading.Event) -> None:
    """A member's heartbeat, on a store connection of its own (the member's may be in a send);
    connected again after a failure, which it logs."""
    from common.weight_sync import open_store

    store = None
    while not stop.wait(HEARTBEAT_S):
        try:
            store = store or open_store(host, port, timeout_s)
            store.add(alive_key(number), 1)
        except Exception as exc:  # noqa: BLE001 - the learner may be gone: the member notices and joins again
            log.warning("weight group heartbeat: %s", first_line(exc))
            store = None


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
        await link.join(record)
        version, path = await link.receive(record)  # staged beside generation: the gate closes only to load
        try:
            await gate.apply(version, lambda: load_path(path))
        finally:
            discard(record, path)
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
                await first_of(announcements.wait(poll_s), stop.wait())  # only the stop cuts an announcement's wait
    finally:
        await announcements.close()


async def first_of(*waits) -> None:
    """Until the first of `waits` returns; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    _done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
