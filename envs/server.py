"""An aiohttp env server speaking the AgentGym "id" protocol.

    GET  /                    health check: a string with the counts of envs
    GET  /stats               the same counts as JSON
    POST /create              {}                       -> {"id": int}
    POST /reset               {"id", "data_idx"}       -> {"id", "observation", "reward", "done", ...}
    POST /step                {"id", "action"}         -> {"observation", "reward", "done", ...}
    GET  /observation?id=     a string
    GET  /oracle?id=          {"action": str}: an expert's next action (our envs only)
    GET  /random?id=          {"action": str}: the random baseline's next action (our envs only)
    GET  /mistake?id=         {"action": str}: a mistake the expert could make now (our envs only)
    GET  /actions?id=         {"actions": [str]}: the admissible actions now (our envs that list them)
    POST /close               {"id"}                   -> true

The extra fields of /reset and /step (`score`, `success`, ...) are the env's own, named as
AgentGym's server of the same env names them.

Fit for slow, heavy envs: every env call runs in a worker thread (one call at a time per
instance), so an env that blocks (a JVM, a planner) never stalls the event loop; a quick
pure-Python env (`Env.blocking = False`) runs on the loop instead, and more worker processes
behind the port give it more cores (`--workers`, envs/workers.py). A crash
inside an instance answers 500 with a JSON error and frees that instance; the others go
on. Past `max_envs` open instances, /create answers 503 with Retry-After. Every instance
belongs to one client (ids start at a random offset, so a restarted server never hands out
an id that a client of its predecessor still holds); instances idle longer than
`idle_ttl_s` are freed (AgentGym's servers never free what a crashed client left behind).
Bad requests get a 4xx answer with a JSON body ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import random
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from common.http import read_body, runner_for
from envs.base import Env, make_env

log = logging.getLogger(__name__)
T = TypeVar("T")
BODY = web.RequestKey("omrl_body", dict)  # a request's JSON body, parsed once


class RequestError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except RequestError as exc:
        return web.json_response({"error": str(exc)}, status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:  # aiohttp's own: no route (404), wrong method (405), a body over the limit (413)
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return web.json_response({"error": f"{request.method} {request.path}: {exc.reason}"}, status=exc.status,
                                 headers=allow)


class _Instance:
    def __init__(self, env: Env):
        self.env = env
        self.lock = asyncio.Lock()  # one call at a time per instance
        self.last_used = time.monotonic()
        self.playing = False  # an episode under way: reset, and no step has ended it
        self.rng = random.Random(0)  # the random and mistake actions' draws, seeded anew at each reset


class EnvServer:
    def __init__(self, env_name: str, options: dict[str, Any] | None = None, idle_ttl_s: float = 600.0,
                 max_envs: int = 4096, threads: int = 32, seed: int = 0, worker: int = 0, workers: int = 1):
        self.env_name, self.options = env_name, dict(options or {})
        probe = make_env(env_name, **self.options)  # fail at start on a bad name or options
        probe.close()
        self.inline = not type(probe).blocking  # its calls run on the event loop (envs/base.py)
        self.idle_ttl_s, self.max_envs = idle_ttl_s, max_envs
        self.instances: dict[int, _Instance] = {}
        # Ids start at a random offset: a client still holding an id of a server that died
        # gets 404 from its successor, never another client's env. Worker `worker` of `workers`
        # (envs/workers.py) hands out the ids equal to `worker` modulo `workers`: the front
        # routes a request by its id alone.
        self._ids = itertools.count(secrets.randbelow(2 ** 40) * workers + worker, workers)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="env")
        self.stats = {"created": 0, "closed": 0, "reaped": 0, "failed": 0, "steps": 0}
        self.seed = seed

    @property
    def envs(self) -> dict[int, Env]:
        return {i: inst.env for i, inst in self.instances.items()}

    # -- helpers --------------------------------------------------------------------------
    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        """The JSON object of the body ({} if none), parsed once a request (a worker's router
        reads it first)."""
        if BODY in request:
            return request[BODY]
        try:  # a client that sends its body slowly holds a request open this long, no longer
            raw = await read_body(request)
        except TimeoutError as exc:
            raise RequestError(408, str(exc)) from None
        if not raw:
            body = {}
        else:
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RequestError(400, f"body is not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise RequestError(400, "body must be a JSON object")
        request[BODY] = body
        return body

    @staticmethod
    def _int(body: dict[str, Any], name: str) -> int:
        value = body.get(name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(400, f"field {name!r} must be an integer, got {value!r}")
        return value

    def _instance(self, env_id: int) -> _Instance:
        inst = self.instances.get(env_id)
        if inst is None:
            raise RequestError(404, f"no env with id {env_id} (closed, reaped after idling, or never created)")
        inst.last_used = time.monotonic()
        return inst

    async def _in_thread(self, call: Callable[[], T]) -> T:
        """`call()` in a worker thread, or here on the loop for an env that does not block."""
        if self.inline:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def _call(self, env_id: int, what: str, call: Callable[[Env], T], in_episode: bool = False,
                    playing: Callable[[T], bool] | None = None) -> T:
        """Run `call(env)` in a worker thread, one call at a time per instance. A RuntimeError
        is the env refusing the request (409; `{id}` in its message becomes the instance's id, as
        AgentGym's messages name it), NotImplementedError a method it lacks (404);
        anything else is a crash: the instance is freed and the client gets 500. Under the
        same lock: `in_episode` refuses the call (409) where no episode is under way, and
        `playing(result)` says whether one is after it."""
        inst = self._instance(env_id)
        async with inst.lock:
            if self.instances.get(env_id) is not inst:
                raise RequestError(404, f"no env with id {env_id} (closed while this request waited)")
            if in_episode and not inst.playing:  # an action means nothing before a reset or after the end
                raise RequestError(409, f"env {env_id} has no episode under way (reset it first; a finished one "
                                        f"has no next action): no {what} action")
            try:
                result = await self._in_thread(lambda: call(inst.env))
                if playing is not None:
                    inst.playing = playing(result)
                return result
            except NotImplementedError as exc:  # (a RuntimeError too) the env has no such method
                raise RequestError(404, str(exc)) from None
            except RuntimeError as exc:
                raise RequestError(409, str(exc).replace("{id}", str(env_id))) from None
            except Exception as exc:  # noqa: BLE001 - a crash costs this instance, never the server
                self.stats["failed"] += 1
                log.exception("env %d crashed in %s: freeing it", env_id, what)
                await self._free(env_id)
                raise RequestError(500, f"env {env_id} crashed in {what}: {type(exc).__name__}: {exc} "
                                        f"(the instance was freed; create a new one)") from None

    async def _free(self, env_id: int) -> None:
        inst = self.instances.pop(env_id, None)
        if inst is not None:
            try:
                await self._in_thread(inst.env.close)
            except Exception:  # noqa: BLE001 - freeing a broken env must not fail the request
                log.exception("closing env %d failed", env_id)

    def counts(self) -> dict[str, int]:
        return {"open": len(self.instances), **self.stats}

    # -- handlers -------------------------------------------------------------------------
    def label(self) -> str:
        """What `GET /` says this server is."""
        return f"{self.env_name} env server"

    async def health(self, request: web.Request) -> web.Response:
        c = self.counts()
        return web.json_response(f"ok: {self.label()}; {c['open']} open, {c['created']} created, "
                                 f"{c['reaped']} reaped, {c['failed']} failed")

    async def stats_view(self, request: web.Request) -> web.Response:
        return web.json_response({"env": self.env_name, **self.counts()})

    async def create(self, request: web.Request) -> web.Response:
        await self._body(request)
        if len(self.instances) >= self.max_envs:
            raise RequestError(503, f"{len(self.instances)} envs open, the limit is {self.max_envs}: close some "
                                    f"or retry later", headers={"Retry-After": "1"})
        try:
            env = await self._in_thread(lambda: make_env(self.env_name, **self.options))
        except Exception as exc:  # noqa: BLE001
            self.stats["failed"] += 1
            log.exception("creating an env failed")
            raise RequestError(500, f"creating an env failed: {type(exc).__name__}: {exc}") from None
        env_id = next(self._ids)
        self.instances[env_id] = _Instance(env)
        self.stats["created"] += 1
        return web.json_response({"id": env_id})

    async def reset(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        env_id, task_idx = self._int(body, "id"), self._int(body, "data_idx")
        # An episode's random and mistake actions depend on the seed and its task alone, not on
        # the order in which concurrent episodes draw: `omrl collect --noise` is reproducible.
        self._instance(env_id).rng = random.Random(f"{self.seed}:{task_idx}")
        observation, fields = await self._call(env_id, "reset", lambda env: (env.reset(task_idx), env.reset_fields()),
                                               playing=lambda _: True)
        return web.json_response({"id": env_id, "observation": observation, "reward": 0.0, "done": False, **fields})

    async def step(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        env_id, action = self._int(body, "id"), body.get("action")
        if not isinstance(action, str):
            raise RequestError(400, f"field 'action' must be a string, got {action!r}")
        result = await self._call(env_id, "step", lambda env: env.step(action), playing=lambda r: not r.done)
        self.stats["steps"] += 1
        return web.json_response({"observation": result.observation, "reward": result.reward,
                                  "done": result.done, **result.info})

    def _query_id(self, request: web.Request) -> int:
        try:
            return int(request.query.get("id", ""))
        except ValueError:
            raise RequestError(400, "query parameter 'id' must be an integer") from None

    async def observation(self, request: web.Request) -> web.Response:
        env_id = self._query_id(request)
        return web.json_response(await self._call(env_id, "observation", lambda env: env.observation()))

    async def oracle(self, request: web.Request) -> web.Response:
        action = await self._call(self._query_id(request), "oracle", lambda env: env.oracle_action(), in_episode=True)
        return web.json_response({"action": action})

    async def actions(self, request: web.Request) -> web.Response:
        actions = await self._call(self._query_id(request), "actions", lambda env: env.actions(), in_episode=True)
        return web.json_response({"actions": actions})

    async def random(self, request: web.Request) -> web.Response:
        env_id = self._query_id(request)
        rng = self._instance(env_id).rng
        action = await self._call(env_id, "random", lambda env: env.random_action(rng), in_episode=True)
        return web.json_response({"action": action})

    async def mistake(self, request: web.Request) -> web.Response:
        env_id = self._query_id(request)
        rng = self._instance(env_id).rng
        action = await self._call(env_id, "mistake", lambda env: env.mistake_action(rng), in_episode=True)
        return web.json_response({"action": action})

    async def close(self, request: web.Request) -> web.Response:
        env_id = self._int(await self._body(request), "id")
        inst = self._instance(env_id)
        async with inst.lock:  # let a call in progress finish first
            await self._free(env_id)
        self.stats["closed"] += 1
        return web.json_response(True)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(self.idle_ttl_s, 30.0))
            cutoff = time.monotonic() - self.idle_ttl_s
            for env_id in [i for i, inst in self.instances.items() if inst.last_used < cutoff and not inst.lock.locked()]:
                await self._free(env_id)
                self.stats["reaped"] += 1
                log.info("freed env %d after %.0fs idle", env_id, self.idle_ttl_s)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors])
        app.add_routes([
            web.get("/", self.health),
            web.get("/stats", self.stats_view),
            web.post("/create", self.create),
            web.post("/reset", self.reset),
            web.post("/step", self.step),
            web.get("/observation", self.observation),
            web.get("/oracle", self.oracle),
            web.get("/random", self.random),
            web.get("/mistake", self.mistake),
            web.get("/actions", self.actions),
            web.post("/close", self.close),
        ])

        async def lifecycle(app: web.Application):
            task = asyncio.create_task(self._reap())
            yield
            task.cancel()
            for env_id in list(self.instances):
                await self._free(env_id)
            self._pool.shutdown(wait=False, cancel_futures=True)

        app.cleanup_ctx.append(lifecycle)
        return app


async def serve(server: EnvServer, host: str, port: int) -> web.AppRunner:
    """Start serving `server` (an EnvServer, or envs.workers.WorkerPool: whatever has `app()`)
    in the running loop; returns the runner (call `await runner.cleanup()`)."""
    runner = runner_for(server.app())
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
