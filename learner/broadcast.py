"""The learner's end of the broadcast transport (rank 0): hosts the rendezvous store, keeps the
members (actors that joined, less those that left or went silent), and sends each new version
once down one chain through all of them (common/weight_sync.py has the protocol).

One thread does it all, beside training: `publish` only hands it the newest version. For each
send it first drops members whose heartbeat stood still, starts a new epoch (a new group) when
the members changed or the last send failed somewhere, sends, then waits for every member's
outcome: got it, failed (alive: it builds the next group), or nothing within `timeout_s`
(dropped). A member that joins gets the version being held at the next send, with the
others relaying it (they already have it and keep what they have)."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid

import msgpack

from common.logs import first_line
from common.weight_sync import (
    HEARTBEAT_S,
    JOINS,
    LEAVES,
    LOCAL_FAILURE,
    POLL_S,
    SENDS,
    STALE_S,
    Packed,
    alive_key,
    dropped_key,
    epoch_key,
    join_key,
    leave_key,
    open_group,
    open_store,
    send_key,
    send_version,
)

log = logging.getLogger(__name__)

MAX_FAILURES = 3  # sends in a row a member may fail before it is dropped
LEFT = "left"  # why a member that said it leaves is no longer one
HOLE_S = 10.0  # a join or leave whose number was taken but whose entry never came is skipped after this


class BroadcastSender:
    def __init__(self, host: str | None, port: int, timeout_s: float):
        self.store = open_store("0.0.0.0", port, timeout_s, master=True)
        self.address = f"{host or socket.gethostname()}:{self.store.port}"
        self.session = uuid.uuid4().hex[:12]  # a restarted learner on the same port is another group
        self.timeout_s = timeout_s
        self.members: dict[int, str] = {}  # join number -> actor name, in chain order
        self.have: dict[int, int] = {}  # join number -> the newest version it got (or could not keep)
        self.sends = 0  # sends made (each one copy of a version out of this process, to the chain's head)
        self.bytes_sent = 0  # what they sent: the learner's send volume, whatever the number of actors
        self.sent = 0  # versions delivered to an actor that did not have them, summed over actors
        self.last_send_s = 0.0  # the last send's own time (to the chain's head)
        self.epochs = 0  # groups built
        self._beats: dict[int, tuple[int, float]] = {}  # join number -> (heartbeat count, when it last moved)
        self._failures: dict[int, int] = {}  # join number -> sends in a row it failed
        self._read = {JOINS: 0, LEAVES: 0}  # join and leave entries read so far
        self._holes: dict[tuple[str, int], float] = {}  # (list, number) -> since when its entry is missing
        self._lock = threading.Lock()  # around changes to `members` (read from other threads)
        self._last_send: tuple[int, tuple[int, ...]] | None = None  # its keys are deleted after the next one
        self._sending = False  # a send (plan, group, transfer, outcomes) under way
        self._epoch: tuple[int, tuple[int, ...], object] | None = None  # (number, members, group)
        self._current: Packed | None = None
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights-sender", daemon=True)
        self._thread.start()

    def publish(self, packed: Packed, step: int) -> dict:
        """The version sent from now on (once to every member, and to each one that joins); its
        record, for `WeightStore.announce`."""
        with self._cond:
            self._current = packed
            self._cond.notify_all()
        return {"version": packed.version, "step": step, "transport": "broadcast", "nbytes": packed.nbytes,
                "sha256": "", "address": self.address, "session": self.session}

    def settled(self, timeout_s: float) -> bool:
        """Whether, within timeout_s, no send is under way and every member has the newest
        version (or could not keep it): the counters are then final for it. An actor applies
        a version before the learner has read its word on it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            packed = self._current
            with self._lock:
                members = list(self.members)
            if not self._sending and (packed is None or all(self.have.get(n, -1) >= packed.version for n in members)):
                return True
            time.sleep(POLL_S)
        return False

    def member_names(self) -> list[str]:
        """The members' names in chain order (a copy: the sender thread changes them)."""
        with self._lock:
            return list(self.members.values())

    def close(self) -> None:
        """Stop sending and free the group and the store now: left to the interpreter's exit,
        gloo's and the store's threads can abort the process ("terminate called without an
        active exception") and turn a finished learner's exit code 0 into a crash."""
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(self.timeout_s + 1)  # a send under way ends within timeout_s
        self._epoch = None
        self.store = None

    # -- the sender thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._admit()
                packed = self._current
                if packed is None or all(self.have.get(n, -1) >= packed.version for n in self.members):
                    with self._cond:
                        self._cond.wait(POLL_S)
                    continue
                self._sending = True
                try:
                    self._send(packed)
                finally:
                    self._sending = False
            except Exception as exc:  # noqa: BLE001 - the store itself failing: closed under us
                if self._closed.is_set():
                    return
                log.warning("weight sender: %s (retrying)", first_line(exc))
                time.sleep(1.0)

    def _admit(self) -> None:
        """Read new joins and leaves."""
        for number, raw in self._entries(JOINS, join_key):
            name = msgpack.unpackb(raw)["name"]
            with self._lock:
                self.members[number] = name
            self._beats[number] = (-1, time.monotonic())
            log.info("actor %s joined the weight group (member %d)", name, number)
        for _, raw in self._entries(LEAVES, leave_key):
            self._drop(int(raw), LEFT)

    def _entries(self, counter: str, key) -> list[tuple[int, bytes]]:
        """The new entries of a numbered list (`join/N`, `leave/N`), in order. A number taken
        (the counter is past it) whose entry never came, its actor having died between the
        two, is skipped after HOLE_S, so it does not hold up every entry after it."""
        found, store = [], self.store
        while True:
            i = self._read[counter]
            if store.check([key(i)]):
                found.append((i, store.get(key(i))))
            elif store.add(counter, 0) <= i:
                return found  # nothing taken past what was read
            elif time.monotonic() - self._holes.setdefault((counter, i), time.monotonic()) > HOLE_S:
                log.warning("%s entry %d never came (its actor died while taking it): skipped", counter, i)
            else:
                return found
            self._holes.pop((counter, i), None)
            self._read[counter] = i + 1

    def _check_beats(self) -> None:
        """Drop members whose heartbeat stood still for STALE_S (read before each send only)."""
        now = time.monotonic()
        for n in list(self.members):
            beats = self.store.add(alive_key(n), 0)
            count, since = self._beats[n]
            if beats != count:
                self._beats[n] = (beats, now)
            elif now - since > STALE_S:
                self._drop(n, f"no heartbeat for {now - since:.0f}s")

    def _drop(self, n: int, why: str) -> None:
        self._failures.pop(n, None)
        with self._lock:
            name = self.members.pop(n, None)
        if name is not None and why == LEFT:
            log.info("actor %s left the weight group", name)
        elif name is not None:
            log.warning("actor %s dropped from the weight group: %s", name, why)
            self.store.set(dropped_key(n), why.encode())  # a member still alive joins again
        self.have.pop(n, None)
        self._beats.pop(n, None)

    def _send(self, packed: Packed) -> None:
        self._check_beats()
        members = tuple(self.members)
        if all(self.have.get(n, -1) >= packed.version for n in members):
            return  # the ones waiting for it were dropped
        k = self.store.add(SENDS, 1) - 1
        self.sends += 1
        new_epoch = self._epoch is None or self._epoch[1] != members
        epoch = self.epochs if new_epoch else self._epoch[0]
        self.store.set(send_key(k), msgpack.packb({"epoch": epoch, "members": list(members),
                                                   "version": packed.version}))
        started = time.perf_counter()
        try:
            if new_epoch:
                self._epoch = None
                self.epochs += 1
                if not self._gather(epoch, members):
                    return
                self._epoch = (epoch, members, open_group(self.store, epoch, 0, 1 + len(members), self.timeout_s))
            sending = time.perf_counter()
            send_version(self._epoch[2], packed)
            self.last_send_s = time.perf_counter() - sending
            self.bytes_sent += packed.nbytes
        except Exception as exc:  # noqa: BLE001 - a member died or hung: the outcomes say which
            log.warning("weight send %d (version %d) failed: %s", k, packed.version, first_line(exc))
            self._epoch = None
        self._outcome(k, epoch, members, packed.version, started)

    def _gather(self, epoch: int, members: tuple[int, ...]) -> bool:
        """Wait for every member of a new epoch to say it is ready, then say go; a member missing
        after timeout_s is dropped and the epoch given up (False): the next send builds another."""
        deadline = time.monotonic() + self.timeout_s
        missing = list(members)
        while missing and time.monotonic() < deadline and not self._closed.is_set():
            missing = [n for n in missing if not self.store.check([epoch_key(epoch, "ready", n)])]
            if missing:
                time.sleep(POLL_S)
        self.store.set(epoch_key(epoch, "go"), b"0" if missing else b"1")
        for n in missing:
            self._drop(n, f"not ready for a new weight group within {self.timeout_s:.0f}s")
        return not missing

    def _outcome(self, k: int, epoch: int, members: tuple[int, ...], version: int, started: float) -> None:
        """Wait up to timeout_s for every member's outcome of send k, and act on it: a member that
        failed MAX_FAILURES sends in a row is dropped (it joins again if it can)."""
        deadline, beats = time.monotonic() + self.timeout_s, time.monotonic()
        while time.monotonic() < deadline and not self._closed.is_set():
            gone = sum(n not in self.members for n in members)  # dropped meanwhile: no word will come
            if self.store.add(send_key(k, "done"), 0) + gone >= len(members) and not any(
                    n in self.members and not self.store.check([send_key(k, "got", n)])
                    and not self.store.check([send_key(k, "failed", n)]) for n in members):
                break
            if time.monotonic() - beats > HEARTBEAT_S:  # a member that died mid-send is dropped at STALE_S
                self._check_beats()
                beats = time.monotonic()
            time.sleep(POLL_S)
        if self._closed.is_set():
            return
        got = [n for n in members if self.store.check([send_key(k, "got", n)])]
        failed = [n for n in members if n not in got and self.store.check([send_key(k, "failed", n)])]
        # A member that could not stage the version (its own disk) relayed it all the same: no new group.
        chain = [n for n in failed if self.store.get(send_key(k, "failed", n)) != LOCAL_FAILURE]
        self._forget_send(k, members)
        self.sent += sum(self.have.get(n, -1) < version for n in got)
        for n in got:
            self.have[n] = max(self.have.get(n, -1), version)
            self._failures.pop(n, None)
        log.info("weight version %d sent to %d of %d actors in %.2fs (group %d)%s", version, len(got), len(members),
                 time.perf_counter() - started, epoch,
                 f"; failed at {[self.members.get(n, n) for n in failed]}" if failed else "")
        if chain:
            self._epoch = None  # their group is gone: the next send builds a new one
        for n in failed:
            if n not in chain:  # it could not keep this version: not sent it again, the next one is tried
                self.have[n] = max(self.have.get(n, -1), version)
            self._failures[n] = self._failures.get(n, 0) + 1
            if self._failures[n] >= MAX_FAILURES:
                self._drop(n, f"failed {MAX_FAILURES} weight sends in a row")
        for n in members:
            if n not in got and n not in failed and n in self.members:
                self._drop(n, f"no word on weight send {k} within {self.timeout_s:g}s")

    def _forget_send(self, k: int, members: tuple[int, ...]) -> None:
        """Delete the store's keys of the send before k: every member has read past it (they take
        sends in order, and k's outcome is in), so the store does not grow with the run."""
        last, self._last_send = self._last_send, (k, members)
        if last is not None:
            old, named = last
            for key in [send_key(old), send_key(old, "done"), *(send_key(old, what, n) for n in named
                                                               for what in ("got", "failed"))]:
                self.store.delete_key(key)
