"""Async client for env servers speaking either AgentGym protocol family (ours or AgentGym's).

Retries follow one declared policy, and only where a retry cannot do a request twice:
- a connection that could not be opened (the server is down or restarting) is retried for
  every request: nothing was sent;
- HTTP 503 (the server refused the work) is retried for every request;
- a timeout or a connection lost after the request was sent is retried only for the
  idempotent requests (`GET /`, `/reset`, `/observation`, `/close`). `/create` and `/step`
  are not: the server may have acted on them, and a step whose answer was lost ends the
  episode's group.
Failures raise `EnvError` subclasses whose `reason` names the group's failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import aiohttp

from common.retry import RetryPolicy
from envs.base import EpisodeError, StepResult
from envs.specs import EnvSpec

log = logging.getLogger(__name__)

# Retry policy: what is retried, how often, and how long to back off.
NOT_SENT = (aiohttp.ClientConnectorError,)  # the connection was never opened
MAYBE_DONE = (aiohttp.ClientConnectionError, asyncio.TimeoutError)  # sent, answer lost
RETRY_STATUS = {503}
IDEMPOTENT = {"/", "/stats", "/reset", "/observation", "/oracle", "/random", "/mistake", "/close"}
MAX_ATTEMPTS = 5
# 0.2 s after the first failure, doubling (the cap is never reached in MAX_ATTEMPTS); each
# request narrows `retryable` to what it may repeat (see above).
POLICY = RetryPolicy(NOT_SENT, attempts=MAX_ATTEMPTS, base_delay_s=0.2, max_delay_s=10.0, logger=log)


class EnvError(EpisodeError):
    """The env server answered with an error; the text carries its message."""

    reason = "env_error"


class EnvBusy(EnvError):
    """HTTP 503: the server refused the work for now (retried by every request)."""


class EnvTimeout(EnvError):
    """A request took longer than env.timeout_s."""

    reason = "env_timeout"


class EnvUnreachable(EnvError):
    """The env server could not be reached, or the connection broke before its answer."""

    reason = "env_unreachable"


class EnvClient:
    """One client for every AgentGym server, both families: "id" (babyai, sciworld,
    textcraft, alfworld, ours...) names the instance `id`; "env_idx" (webshop, sqlgym, the
    tool envs...) names it `env_idx`. Every answer shape is read (see `observation_of`,
    `step_result`); errors answered as HTTP 200 with {"error": ...} raise EnvError like 4xx."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession, timeout_s: float = 300.0,
                 spec: EnvSpec | None = None, reuse: bool = True):
        self.base_url = base_url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.spec = spec or EnvSpec("env")
        self.key = "env_idx" if self.spec.protocol == "env_idx" else "id"
        # A server of several workers (envs/workers.py) names in /create's answer the worker that
        # holds the instance: its requests go straight there, unless one could not be reached.
        self.endpoints: dict[int, str] = {}
        self.direct = True
        # Instances whose episode ended in good order, kept for the next `start` (env.reuse_instances).
        self.reuse = reuse
        self.kept: list[int] = []

    async def _request(self, method: str, path: str, attempts: int = MAX_ATTEMPTS, env_id: int | None = None,
                       **kwargs: Any) -> Any:
        url = f"{self.base_url}{path}"
        retryable = (*NOT_SENT, *MAYBE_DONE, EnvBusy) if path in IDEMPOTENT else (*NOT_SENT, EnvBusy)

        async def answer(resp: aiohttp.ClientResponse) -> Any:
            try:
                body = await resp.json(content_type=None)
            except ValueError:
                error = EnvError(f"{method} {path}: HTTP {resp.status}: the answer is not JSON")
            else:
                if resp.status < 400 and not (isinstance(body, dict) and "error" in body):
                    return body
                message = body.get("error") if isinstance(body, dict) else body
                error = EnvError(f"{method} {path}: HTTP {resp.status}: {message}")
            if resp.status in RETRY_STATUS:
                raise EnvBusy(str(error))
            raise error

        async def once() -> Any:
            endpoint = self.endpoints.get(env_id) if env_id is not None else None
            try:
                async with self.session.request(method, f"{endpoint}{path}" if endpoint else url,
                                                timeout=self.timeout, **kwargs) as resp:
                    return await answer(resp)
            except NOT_SENT:
                if endpoint is None:
                    raise
            # Nothing was sent to the worker: the front forwards it. Where the front reaches the worker
            # (no 502), its port is closed to us (not published from a container): the front serves all.
            self.endpoints.pop(env_id, None)
            async with self.session.request(method, url, timeout=self.timeout, **kwargs) as resp:
                if resp.status != 502 and self.direct:
                    log.warning("env worker at %s unreachable from here: going through %s", endpoint, self.base_url)
                    self.direct = False
                    self.endpoints.clear()
                return await answer(resp)

        try:
            return await dataclasses.replace(POLICY, retryable=retryable, attempts=attempts).run(f"{method} {url}", once)
        except (*NOT_SENT, *MAYBE_DONE) as exc:
            raise _failure(method, path, exc) from exc

    async def health(self, attempts: int = MAX_ATTEMPTS) -> str:
        return await self._request("GET", "/", attempts=attempts)

    async def create(self) -> int:
        """A new instance: {"id": n} (id family), a bare int or {"env_idx": n} (env_idx family)."""
        kwargs = {"json": self.spec.create_body} if self.spec.create_body is not None else {}
        body = await self._request("POST", "/create", **kwargs)
        if isinstance(body, int) and not isinstance(body, bool):
            return body
        if isinstance(body, dict):
            for key in ("id", "env_idx"):
                if isinstance(body.get(key), int):
                    if self.direct and isinstance(body.get("endpoint"), str):
                        self.endpoints[body[key]] = body["endpoint"].rstrip("/")
                    return body[key]
        raise EnvError(f"POST /create: no instance id in the answer {str(body)[:200]!r}")

    async def reset(self, env_id: int, task_idx: int) -> StepResult:
        body = await self._request("POST", "/reset", env_id=env_id, json={self.key: env_id, **self.spec.reset_body(task_idx)})
        observation = observation_of(body, "POST /reset")
        prefix = body.get(self.spec.reset_prefix) if self.spec.reset_prefix and isinstance(body, dict) else None
        if isinstance(prefix, str):
            observation = prefix + "\n" + observation
        return StepResult(observation, self._reward(body), False, _fields(body))

    async def step(self, env_id: int, action: str) -> StepResult:
        """The answer as a StepResult; `reward` is the spec's reward field, scaled (a running
        total where `spec.reward_is_total`)."""
        body = await self._request("POST", "/step", env_id=env_id, json={self.key: env_id, "action": action})
        return step_result(body, self.spec)

    async def observation(self, env_id: int) -> str:
        return observation_of(await self._request("GET", "/observation", env_id=env_id, params={self.key: str(env_id)}),
                              "GET /observation")

    async def oracle_action(self, env_id: int) -> str:
        """An expert's next action (our env servers only)."""
        return (await self._request("GET", "/oracle", env_id=env_id, params={"id": str(env_id)}))["action"]

    async def random_action(self, env_id: int) -> str:
        """The random baseline's next action (our env servers only)."""
        return (await self._request("GET", "/random", env_id=env_id, params={"id": str(env_id)}))["action"]

    async def mistake_action(self, env_id: int) -> str:
        """A mistake the expert could make now (our env servers only)."""
        return (await self._request("GET", "/mistake", env_id=env_id, params={"id": str(env_id)}))["action"]

    async def actions(self, env_id: int) -> list[str]:
        """The actions the env admits now (our env servers that list them: `actor.constrain_actions`)."""
        return (await self._request("GET", "/actions", env_id=env_id, params={"id": str(env_id)}))["actions"]

    async def close(self, env_id: int) -> bool:
        try:
            return bool(await self._request("POST", "/close", env_id=env_id, json={self.key: env_id}))
        finally:
            self.endpoints.pop(env_id, None)

    async def start(self, task_idx: int) -> tuple[int, StepResult]:
        """An instance reset to `task_idx`, and the reset's answer: one an earlier episode left
        in good order where one is kept (no /create now and no /close later: two round trips an
        episode fewer; AgentGym's own clients reset one instance task after task), else a new
        one. A kept instance whose reset fails (reaped after idling, the server restarted) is
        closed and a new one reset instead, so its failure costs no episode."""
        while self.kept:
            env_id = self.kept.pop()
            try:
                return env_id, await self.reset(env_id, task_idx)
            except EnvError as exc:
                log.debug("kept env %d did not reset (%s): a new one", env_id, exc)
                await self.close_quietly(env_id)
        env_id = await self.create()
        try:
            return env_id, await self.reset(env_id, task_idx)
        except BaseException:
            await self.close_quietly(env_id)
            raise

    async def finish(self, env_id: int, in_order: bool) -> None:
        """The episode on `env_id` is over: the instance is kept for the next `start` where the
        episode ended in good order (no error, not cancelled) and reuse is on, else closed."""
        if in_order and self.reuse:
            self.kept.append(env_id)
        else:
            await self.close_quietly(env_id)

    async def close_kept(self) -> None:
        """Close every kept instance (the client's owner is done with the server)."""
        kept, self.kept = self.kept, []
        await asyncio.gather(*[self.close_quietly(env_id) for env_id in kept])

    async def close_quietly(self, env_id: int) -> None:
        """Free an env at the end of an episode, once, without failing it: a server that is
        gone has nothing to free, servers free idle envs on their own, and some AgentGym
        servers have no /close."""
        try:
            await self._request("POST", "/close", attempts=1, env_id=env_id, json={self.key: env_id})
        except EnvError as exc:
            log.debug("close of env %d failed: %s", env_id, exc)
        finally:
            self.endpoints.pop(env_id, None)

    def _reward(self, body: Any) -> float:
        return _number(body, self.spec.reward_field) * self.spec.reward_scale if isinstance(body, dict) else 0.0


def observation_of(body: Any, where: str) -> str:
    """The observation in any answer shape: a string; [observation, null] (webshop, sqlgym
    /reset); an object with `observation` or `state` (webshop, sqlgym /step)."""
    if isinstance(body, str):
        return body
    if isinstance(body, list) and body and isinstance(body[0], str):
        return body[0]
    if isinstance(body, dict):
        for key in ("observation", "state"):
            if isinstance(body.get(key), str):
                return body[key]
    raise EnvError(f"{where}: no observation in the answer {str(body)[:200]!r}")


def step_result(body: Any, spec: EnvSpec) -> StepResult:
    if not isinstance(body, dict):
        raise EnvError(f"POST /step: the answer is a {type(body).__name__}, expected an object")
    done = bool(body.get("done") or body.get("terminated") or body.get("truncated"))
    return StepResult(observation_of(body, "POST /step"), _number(body, spec.reward_field) * spec.reward_scale,
                      done, _fields(body))


def _number(body: dict[str, Any], field: str) -> float:
    value = body.get(field, 0.0)
    if value is None:
        return 0.0
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise EnvError(f"answer field {field!r} is {value!r}, not a number")
    return float(value)


def _fields(body: Any) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("observation", "state")} if isinstance(body, dict) else {}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _failure(method: str, path: str, exc: BaseException) -> EnvError:
    if isinstance(exc, asyncio.TimeoutError):
        return EnvTimeout(f"{method} {path}: no answer within the timeout")
    return EnvUnreachable(f"{method} {path}: {_describe(exc)}")
