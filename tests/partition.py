"""A TCP proxy that can cut the link it carries and heal it, as toxiproxy does: the network
partition of tests/e2e/test_partitions.py, in front of Redis or an env server.

While cut, nothing crosses in either direction and nothing is refused: bytes already sent
wait in the proxy (and, past its buffer, in the kernel's), a new connection is accepted and
waits to be carried through. That is what a client sees of a peer behind a dropped link: no
error, no answer, until its own timeouts fire. On heal, what waited goes on where it was,
as TCP's retransmissions would carry it; a client that gave up meanwhile has closed its
connection and opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from broker.embedded import free_port

CHUNK = 64 * 1024


class Partition:
    """`with Partition(port_of_target) as link:` clients connect to `link.port`; `link.cut()`,
    `link.heal()` from the test's thread."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.port = free_port()
        self.connections = 0  # accepted so far
        self._loop = asyncio.new_event_loop()
        self._open: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"partition-{self.port}", daemon=True)

    def __enter__(self) -> Partition:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the partition proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def cut(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._open = asyncio.Event()
        self._open.set()
        self._loop.run_until_complete(asyncio.start_server(self._carry, "127.0.0.1", self.port))
        self._started.set()
        self._loop.run_forever()

    async def _carry(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await self._open.wait()  # accepted, but not carried through while cut
        try:
            target_reader, target_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()  # the target is down: the client sees the connection end
            return
        await asyncio.gather(self._pump(client_reader, target_writer), self._pump(target_reader, client_writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(CHUNK):
                await self._open.wait()  # held while cut
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()
