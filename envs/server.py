"""An aiohttp env server speaking the AgentGym "id" protocol.

    GET  /                    health check: a string
    POST /create              {}                       -> {"id": int}
    POST /reset               {"id", "data_idx"}       -> {"observation", "reward", "done", "id"}
    POST /step                {"id", "action"}         -> {"observation", "reward", "done", "info"}
    GET  /observation?id=     a string
    POST /close               {"id"}                   -> true

Every env instance belongs to one client (ids start at a random offset, so a restarted
server never hands out an id that a client of its predecessor still holds); instances idle
longer than `idle_ttl_s` are freed (AgentGym's servers never free what a crashed client left behind). Bad requests
get a 4xx answer with a JSON body ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import logging
import time
from typing import Any

from aiohttp import web

from envs.base import Env, make_env

log = logging.getLogger(__name__)


class RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except RequestError as exc:
        return _error(exc.status, str(exc))


class EnvServer:
    def __init__(self, env_name: str, options: dict[str, Any] | None = None, idle_ttl_s: float = 600.0,
                 max_envs: int = 100_000):
        self.env_name, self.options = env_name, dict(options or {})
        make_env(env_name, **self.options)  # fail at start on a bad name or options
        self.idle_ttl_s, self.max_envs = idle_ttl_s, max_envs
        self.envs: dict[int, Env] = {}
        self.last_used: dict[int, float] = {}
        # Ids start at a random offset: a client still holding an id of a server that died
        # gets 404 from its successor, never another client's env.
        self._ids = itertools.count(secrets.randbelow(2 ** 40))
        self.stats = {"created": 0, "closed": 0, "reaped": 0, "steps": 0}

    # -- helpers --------------------------------------------------------------------------
    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            raise RequestError(400, f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "body must be a JSON object")
        return body

    @staticmethod
    def _int(body: dict[str, Any], name: str) -> int:
        value = body.get(name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(400, f"field {name!r} must be an integer, got {value!r}")
        return value

    def _env(self, env_id: int) -> Env:
        env = self.envs.get(env_id)
        if env is None:
            raise RequestError(404, f"no env with id {env_id} (closed, reaped after idling, or never created)")
        self.last_used[env_id] = time.monotonic()
        return env

    # -- handlers -------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(f"ok: {self.env_name} env server, {len(self.envs)} envs")

    async def create(self, request: web.Request) -> web.Response:
        await self._body(request)
        if len(self.envs) >= self.max_envs:
            raise RequestError(503, f"{len(self.envs)} envs open, the limit is {self.max_envs}: close some")
        env_id = next(self._ids)
        self.envs[env_id] = make_env(self.env_name, **self.options)
        self.last_used[env_id] = time.monotonic()
        self.stats["created"] += 1
        return web.json_response({"id": env_id})

    async def reset(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        env_id, task_idx = self._int(body, "id"), self._int(body, "data_idx")
        observation = self._env(env_id).reset(task_idx)
        return web.json_response({"id": env_id, "observation": observation, "reward": 0.0, "done": False})

    async def step(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        env_id, action = self._int(body, "id"), body.get("action")
        if not isinstance(action, str):
            raise RequestError(400, f"field 'action' must be a string, got {action!r}")
        try:
            result = self._env(env_id).step(action)
        except RuntimeError as exc:
            raise RequestError(409, str(exc)) from None
        self.stats["steps"] += 1
        return web.json_response({"observation": result.observation, "reward": result.reward,
                                  "done": result.done, "info": result.info})

    async def observation(self, request: web.Request) -> web.Response:
        try:
            env_id = int(request.query.get("id", ""))
        except ValueError:
            raise RequestError(400, "query parameter 'id' must be an integer") from None
        return web.json_response(self._env(env_id).observation())

    async def close(self, request: web.Request) -> web.Response:
        env_id = self._int(await self._body(request), "id")
        self._env(env_id)
        del self.envs[env_id], self.last_used[env_id]
        self.stats["closed"] += 1
        return web.json_response(True)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(self.idle_ttl_s, 30.0))
            cutoff = time.monotonic() - self.idle_ttl_s
            for env_id in [i for i, t in self.last_used.items() if t < cutoff]:
                del self.envs[env_id], self.last_used[env_id]
                self.stats["reaped"] += 1
                log.info("freed env %d after %.0fs idle", env_id, self.idle_ttl_s)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors])
        app.add_routes([
            web.get("/", self.health),
            web.post("/create", self.create),
            web.post("/reset", self.reset),
            web.post("/step", self.step),
            web.get("/observation", self.observation),
            web.post("/close", self.close),
        ])

        async def reaper(app: web.Application):
            task = asyncio.create_task(self._reap())
            yield
            task.cancel()

        app.cleanup_ctx.append(reaper)
        return app


async def serve(server: EnvServer, host: str, port: int) -> web.AppRunner:
    """Start serving in the running loop; returns the runner (call `await runner.cleanup()`)."""
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
