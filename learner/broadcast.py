"""The learner's end of the broadcast transport (rank 0): hosts the rendezvous store, builds
a group with each actor that joins, and sends a link the newest version whenever its actor
asks (common/weight_sync.py has the protocol). Each link runs in a thread of its own; a
link whose collective fails or times out is closed and logged, and the others go on."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid

import msgpack

from common.logs import first_line
from common.weight_sync import Packed, open_group, open_store, send_version

log = logging.getLogger(__name__)

POLL_S = 0.01  # how often a link looks for its actor's request (a TCPStore key)


class BroadcastSender:
    def __init__(self, host: str | None, port: int, backend: str, timeout_s: float):
        self.store = open_store("0.0.0.0", port, timeout_s, master=True)
        self.address = f"{host or socket.gethostname()}:{self.store.port}"
        self.session = uuid.uuid4().hex[:12]  # a restarted learner on the same port is another group
        self.backend, self.timeout_s = backend, timeout_s
        self.links: dict[int, str] = {}  # link number -> actor name, while its group is up
        self.sent = 0  # versions sent, over all links
        self._current: Packed | None = None
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._accept, name="weights-accept", daemon=True)]
        self._threads[0].start()

    def publish(self, packed: Packed, step: int) -> dict:
        """The version links send from now on (to each actor when it asks); its record, for
        `WeightStore.announce`."""
        with self._cond:
            self._current = packed
            self._cond.notify_all()
        return {"version": packed.version, "step": step, "transport": "broadcast", "nbytes": packed.nbytes,
                "sha256": "", "address": self.address, "session": self.session, "backend": self.backend}

    def close(self, wait_s: float = 5.0) -> None:
        """End the links and free their groups and the store now: left to the interpreter's
        exit, gloo's and the store's threads can abort the process ("terminate called without
        an active exception") and turn a finished learner's exit code 0 into a crash."""
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        for thread in list(self._threads):
            thread.join(wait_s)  # a link in the middle of a send ends within weights.timeout_s
        self.store = None

    def _accept(self) -> None:
        number = 0
        while not self._closed.is_set():
            if not self.store.check([f"join/{number}"]):
                time.sleep(POLL_S * 10)
                continue
            info = msgpack.unpackb(self.store.get(f"join/{number}"))
            thread = threading.Thread(target=self._serve, args=(number, info), name=f"weights-link-{number}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()
            number += 1

    def _serve(self, number: int, info: dict) -> None:
        link, actor = f"link/{number}", info["name"]
        try:
            group = open_group(self.store, link, 0, info["world"], self.backend, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the actor went away mid-join; it joins again
            log.warning("actor %s did not complete joining the weight group (%s)", actor, first_line(exc))
            return
        self.links[number] = actor
        log.info("actor %s joined the weight group (link %d, %d workers)", actor, number, info["world"] - 1)
        want = f"{link}/want"
        try:
            while not self._closed.is_set():
                if not self.store.check([want]):
                    time.sleep(POLL_S)
                    continue
                self.store.delete_key(want)
                with self._cond:
                    self._cond.wait_for(lambda: self._current is not None or self._closed.is_set())
                    packed = self._current
                if packed is None:
                    return
                t0 = time.perf_counter()
                send_version(group, packed)
                with self._cond:  # links run in threads of their own
                    self.sent += 1
                log.info("sent weight version %d to actor %s (%.0f MB in %.2fs)", packed.version, actor,
                         packed.nbytes / 1e6, time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - a dead or hung actor costs its own link only
            log.warning("weight link to actor %s closed: %s (it joins again when it can)", actor, first_line(exc))
        finally:
            self.links.pop(number, None)
            del group

