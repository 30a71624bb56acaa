"""`omrl env-server --workers N`: N env server processes behind one port, for envs whose
calls hold the GIL (BabyAI's level generation and path searches are pure Python: one
process serves one core, whatever its threads; an env that releases the GIL, a JVM say,
scales with the threads of one process instead).

Every worker listens on the shared port (SO_REUSEPORT: the kernel spreads connections over
them) and on a port of its own. Worker i of N is an `EnvServer` handing out the ids equal to
i modulo N, so an instance lives in the worker that created it, and any worker knows any
id's owner from the id alone: a request for another worker's instance is forwarded to the
owner's port (no table). A /create goes to the worker with the fewest open instances (a
count per worker in memory they share), wherever its connection landed. The /create answer
adds the worker's own address
(`"endpoint": "http://HOST:PORT"`, HOST as the client named the server): our client
(envs/client.py) sends that instance's requests straight there, so none is forwarded;
other clients ignore the field and are forwarded where they land elsewhere. An endpoint
the client cannot reach (a port not published from a container) is dropped at the first
refused connection, and the shared port serves that client from then on.

Ports: with env.port P fixed, worker i's own is P + 1 + i (publish them all to reach them
from outside a container); with P = 0 all are free ports picked at start.

The parent process only supervises: a worker that dies is started again on its ports, and so
is one whose event loop stops turning (it beats into memory the parent shares, once a second;
no beat for `hang_s`, supervisor.hang_s: killed, then started again). Its instances are gone
(their requests answer 404, as after any restart: ids start at a random offset; 502 while it
starts), so the episodes on it fail with a reason and the others go on. `/stats` on any port
adds up every worker's counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import signal
import time
from typing import Any

import aiohttp
from aiohttp import web

from common.http import runner_for
from common.retry import wait_set
from envs.server import EnvServer, RequestError

log = logging.getLogger(__name__)

RESTART_CHECK_S = 0.5  # how often the parent looks for dead workers
START_TIMEOUT_S = 120.0  # a worker must be listening within this (a JVM env starts in seconds)
COUNTS = ("open", "created", "closed", "reaped", "failed", "steps")
FORWARDED = "X-Omrl-Forwarded"  # on a request one worker passed to another: served there, never passed on


class _Down(RequestError):
    """The worker a request was for refused the connection: nothing was sent to it."""


class WorkerServer(EnvServer):
    """Worker `worker` of len(`ports`): serves its own instances, forwards requests for the
    others' to their owner's port (`ports[owner]`), and names its own port in /create."""

    def __init__(self, env_name: str, options: dict[str, Any] | None, worker: int, ports: list[int], host: str,
                 loads: Any = None):
        super().__init__(env_name, options, worker=worker, workers=len(ports))
        self.worker, self.ports = worker, ports
        # Every worker's count of open instances, in memory the parent shares with all: a /create
        # goes to the worker with the fewest, whichever worker the connection landed on.
        self.loads = loads if loads is not None else [0] * len(ports)
        self._local = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host  # where siblings are reached
        self._session: aiohttp.ClientSession | None = None

    async def _owner(self, request: web.Request) -> int | None:
        """The worker holding the request's instance, or None where the request names none
        (/create, a health check, a malformed request: served here, which answers the error)."""
        env_id: Any = request.query.get("id")
        if env_id is None:
            try:
                env_id = (await self._body(request)).get("id")
            except RequestError:
                return None
        if env_id is None or isinstance(env_id, bool):
            return None
        try:
            return int(env_id) % len(self.ports)
        except (TypeError, ValueError):
            return None

    async def _forward(self, owner: int, request: web.Request, body: bytes) -> web.Response:
        url = f"http://{self._local}:{self.ports[owner]}{request.path_qs}"
        # The client's Host (the owner's /create names its port under it), and a mark: served where it lands.
        headers = {"Host": request.host, FORWARDED: "1"}
        if body and "Content-Type" in request.headers:
            headers["Content-Type"] = request.headers["Content-Type"]
        try:
            async with self._session.request(request.method, url, data=body or None, headers=headers) as resp:
                data = await resp.read()
                kept = {k: v for k, v in resp.headers.items() if k == "Retry-After"}
                return web.Response(body=data, status=resp.status, content_type=resp.content_type, headers=kept)
        except aiohttp.ClientConnectorError as exc:
            raise _Down(502, f"env worker {owner} is down ({type(exc).__name__}: {exc}): it is being started "
                             f"again; the envs it held are gone") from None
        except aiohttp.ClientError as exc:
            raise RequestError(502, f"env worker {owner} did not answer ({type(exc).__name__}: {exc}): it is being "
                                    f"started again; the envs it held are gone") from None

    @web.middleware
    async def _route(self, request: web.Request, handler):
        if request.headers.get(FORWARDED):
            return await handler(request)
        owner = self._least_loaded() if request.path == "/create" else await self._owner(request)
        if owner is not None and owner != self.worker:
            try:
                return await self._forward(owner, request, await request.read())
            except _Down:
                if request.path != "/create":
                    raise
                # The least loaded is being started again (nothing was sent to it): this one creates.
        return await handler(request)

    def _least_loaded(self) -> int:
        """The worker with the fewest open instances (this one among equals)."""
        loads = list(self.loads)  # one look: the others change theirs meanwhile
        fewest = min(loads)
        return self.worker if loads[self.worker] == fewest else loads.index(fewest)

    def _count(self) -> None:
        self.loads[self.worker] = len(self.instances)

    def label(self) -> str:
        return f"{self.env_name} env server, worker {self.worker} of {len(self.ports)} (GET /stats: every worker's)"

    def _own_counts(self) -> dict[str, Any]:
        return {"env": self.env_name, "pid": os.getpid(), **self.counts()}

    async def _free(self, env_id: int) -> None:
        await super()._free(env_id)
        self._count()

    async def create(self, request: web.Request) -> web.Response:
        response = await super().create(request)
        self._count()
        answer = json.loads(response.body)
        return web.json_response({**answer, "endpoint": f"http://{request.url.host}:{self.ports[self.worker]}"})

    async def stats_view(self, request: web.Request) -> web.Response:
        """Every worker's counts and their sums (`?local=1`: this worker's alone)."""
        if request.query.get("local"):
            return web.json_response(self._own_counts())

        async def one(index: int) -> dict[str, Any]:
            counts: dict[str, Any] = {}
            if index == self.worker:
                counts = self._own_counts()
            else:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    url = f"http://{self._local}:{self.ports[index]}/stats?local=1"
                    async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                        counts = await resp.json() if resp.status == 200 else {}
            return {"worker": index, "port": self.ports[index], "up": bool(counts), **counts}

        workers = list(await asyncio.gather(*[one(i) for i in range(len(self.ports))]))
        totals = {key: sum(w.get(key, 0) for w in workers) for key in COUNTS}
        return web.json_response({"env": self.env_name, **totals, "workers": workers})

    def app(self) -> web.Application:
        app = super().app()
        app.middlewares.append(self._route)

        async def session(app: web.Application):
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                  timeout=aiohttp.ClientTimeout(total=None))
            yield
            await self._session.close()

        app.cleanup_ctx.append(session)
        return app


def _worker_main(env_name: str, options: dict[str, Any], worker: int, ports: list[int], shared: int, host: str,
                 log_level: str, loads, beats, pipe) -> None:
    """A worker process: listen on its own port, say so on `pipe` (None, or the error that
    stopped it), then on the shared port once the parent says (every sibling is up by then:
    nothing is forwarded to one still starting); serve until SIGTERM."""
    from common.liveness import beating
    from common.logs import setup_logging

    setup_logging(f"env-worker-{worker}", log_level)

    async def main() -> None:
        try:
            loads[worker] = 0  # a worker started again holds nothing
            runner = runner_for(WorkerServer(env_name, options, worker, ports, host, loads).app())
            await runner.setup()
            await web.TCPSite(runner, host, ports[worker]).start()
            pipe.send(None)
            await asyncio.to_thread(pipe.recv)
            await web.TCPSite(runner, host, shared, reuse_port=True).start()
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails naming it
            pipe.send(f"{type(exc).__name__}: {exc}")
            return
        pipe.send(None)
        beats_task = asyncio.create_task(beating(touch=lambda: beats.__setitem__(worker, time.time())))
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        beats_task.cancel()
        await runner.cleanup()

    asyncio.run(main())


class WorkerPool:
    """The parent of the workers: starts them, starts again those that die, stops them."""

    def __init__(self, env_name: str, options: dict[str, Any] | None, workers: int, host: str, port: int,
                 log_level: str = "INFO", hang_s: float = 0.0):
        from broker.embedded import free_port

        if workers < 2:
            raise ValueError(f"env.workers must be at least 2 for a pool of workers, got {workers}")
        EnvServer(env_name, options)  # fail here, at once, on a bad name or options
        self.env_name, self.options, self.host, self.log_level = env_name, dict(options or {}), host, log_level
        self.port = port or free_port(host)
        self.ports = [port + 1 + i if port else free_port(host) for i in range(workers)]
        self.procs: list[multiprocessing.Process | None] = [None] * workers
        self.restarts = [0] * workers
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads and a loop
        self.loads = self._ctx.Array("q", workers, lock=False)  # each worker writes its own slot alone
        self.beats = self._ctx.Array("d", workers, lock=False)  # time.time() of each worker's last beat (0: none)
        self.hang_s = hang_s  # a worker with no beat this long is killed and started again (0: never)

    async def _start(self, worker: int) -> Any:
        """Start a worker and wait until it listens on its own port; its end of the pipe."""
        pipe, theirs = self._ctx.Pipe()
        self.beats[worker] = 0.0  # its predecessor's last beat is not its own
        proc = self.procs[worker] = self._ctx.Process(
            target=_worker_main, name=f"env-worker-{worker}", daemon=True,
            args=(self.env_name, self.options, worker, self.ports, self.port, self.host, self.log_level, self.loads,
                  self.beats, theirs))
        proc.start()
        theirs.close()
        await self._answer(worker, pipe, f"its port {self.ports[worker]}")
        return pipe

    async def _share(self, worker: int, pipe) -> None:
        """Let a started worker listen on the shared port too."""
        try:
            pipe.send("listen")
            await self._answer(worker, pipe, f"the shared port {self.port}")
        finally:
            pipe.close()

    async def _answer(self, worker: int, pipe, where: str) -> None:
        proc = self.procs[worker]
        try:
            if not await asyncio.to_thread(pipe.poll, START_TIMEOUT_S):
                raise RuntimeError(f"env worker {worker} did not listen on {where} within {START_TIMEOUT_S:.0f}s")
            error = pipe.recv()
        except (EOFError, BrokenPipeError):
            raise RuntimeError(f"env worker {worker} exited with {proc.exitcode} before listening on {where} "
                               f"(its log says why)") from None
        if error is not None:
            raise RuntimeError(f"env worker {worker} could not listen on {where}: {error}")

    async def run(self, stop: asyncio.Event, started: asyncio.Event | None = None) -> None:
        """Start every worker, then start again each one that dies, until `stop` is set;
        `started` is set once all listen."""
        try:
            pipes = await asyncio.gather(*[self._start(i) for i in range(len(self.procs))])
            await asyncio.gather(*[self._share(i, pipe) for i, pipe in enumerate(pipes)])
            if started is not None:
                started.set()
            while not stop.is_set():
                await wait_set(stop, RESTART_CHECK_S)
                for worker, proc in enumerate(self.procs):
                    since = time.time() - self.beats[worker]
                    if self.hang_s and proc is not None and proc.is_alive() and self.beats[worker] and since > self.hang_s:
                        log.error("env worker %d made no progress for %.0fs (supervisor.hang_s = %g): killing it",
                                  worker, since, self.hang_s)
                        proc.kill()
                        await asyncio.to_thread(proc.join)
                    if not stop.is_set() and proc is not None and not proc.is_alive():
                        log.warning("env worker %d exited with %s: starting it again (its %s envs are gone)",
                                    worker, proc.exitcode, self.env_name)
                        self.restarts[worker] += 1
                        try:
                            await self._share(worker, await self._start(worker))
                        except RuntimeError as exc:
                            log.error("%s; trying again", exc)
        finally:
            await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            if proc is not None:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
