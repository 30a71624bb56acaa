"""The single bridge thread between the asyncio broker and the synchronous learner: it
reads rollout groups into a bounded queue, sends undecodable ones to the dead letters, and
runs the learner's broker calls (ack, publish) on its own event loop."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Coroutine

from broker.keys import Keys
from broker.streams import RolloutConsumer, connect
from broker.weights import WeightStore
from common.messages import CodecError, RolloutGroup, decode_group

log = logging.getLogger(__name__)


class BrokerBridge:
    def __init__(self, url: str, keys: Keys, consumer: str, keep_versions: int, queue_size: int, read_count: int):
        self.queue: queue.Queue[tuple[str, bytes, RolloutGroup]] = queue.Queue(maxsize=queue_size)
        self.read_count = read_count
        self.client = connect(url, blocking=True)
        self.consumer = RolloutConsumer(self.client, keys, consumer)
        self.store = WeightStore(self.client, keys, keep=keep_versions)
        self.dead_letters = 0
        self._loop = asyncio.new_event_loop()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="broker-bridge", daemon=True)

    def start(self, timeout: float = 30.0) -> "BrokerBridge":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("broker bridge did not connect to Redis in time")
        self.check()
        return self

    def check(self) -> None:
        """Re-raise in the caller's thread an error that stopped the bridge."""
        if self._error is not None:
            raise RuntimeError("broker bridge failed") from self._error

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        """Run a broker coroutine on the bridge's loop and wait for its result."""
        self.check()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def get(self, timeout: float) -> tuple[str, bytes, RolloutGroup] | None:
        self.check()
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except Exception as exc:  # noqa: BLE001 - surfaced to the learner thread by check()
            self._error = exc
            self._ready.set()
        finally:
            self._loop.run_until_complete(self.client.aclose())

    async def _main(self) -> None:
        await self.consumer.ensure_group()
        self._ready.set()
        while not self._stop.is_set():
            for entry_id, data in await self.consumer.read(self.read_count, block_ms=500):
                if data is None:  # payload deleted after a previous delivery
                    await self.consumer.ack([entry_id])
                    continue
                try:
                    group = decode_group(data)
                except CodecError as exc:
                    self.dead_letters += 1
                    await self.consumer.dead_letter(entry_id, data, "invalid", str(exc))
                    continue
                while not self._stop.is_set():
                    try:
                        self.queue.put_nowait((entry_id, data, group))
                        break
                    except queue.Full:
                        await asyncio.sleep(0.01)
