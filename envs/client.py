"""Async client for env servers speaking the AgentGym "id" protocol (ours or AgentGym's).

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
import logging
import random
from typing import Any

import aiohttp

from envs.base import StepResult

log = logging.getLogger(__name__)

# Retry policy: what is retried, how often, and how long to back off.
NOT_SENT = (aiohttp.ClientConnectorError,)  # the connection was never opened
MAYBE_DONE = (aiohttp.ClientConnectionError, asyncio.TimeoutError)  # sent, answer lost
RETRY_STATUS = {503}
IDEMPOTENT = {"/", "/reset", "/observation", "/close"}
MAX_ATTEMPTS = 5
BACKOFF_S = 0.2


class EnvError(RuntimeError):
    """The env server answered with an error; the text carries its message."""

    reason = "env_error"


class EnvTimeout(EnvError):
    """A request took longer than env.timeout_s."""

    reason = "env_timeout"


class EnvUnreachable(EnvError):
    """The env server could not be reached, or the connection broke before its answer."""

    reason = "env_unreachable"


class EnvClient:
    def __init__(self, base_url: str, session: aiohttp.ClientSession, timeout_s: float = 300.0):
        self.base_url = base_url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _request(self, method: str, path: str, attempts: int = MAX_ATTEMPTS, **kwargs: Any) -> Any:
        url = f"{self.base_url}{path}"
        retryable = (*NOT_SENT, *MAYBE_DONE) if path in IDEMPOTENT else NOT_SENT
        for attempt in range(1, attempts + 1):
            try:
                async with self.session.request(method, url, timeout=self.timeout, **kwargs) as resp:
                    if resp.status in RETRY_STATUS and attempt < attempts:
                        raise _Retry(f"HTTP {resp.status}")
                    try:
                        body = await resp.json(content_type=None)
                    except ValueError:
                        raise EnvError(f"{method} {path}: HTTP {resp.status}: the answer is not JSON") from None
                    if resp.status >= 400 or (isinstance(body, dict) and "error" in body):
                        message = body.get("error") if isinstance(body, dict) else body
                        raise EnvError(f"{method} {path}: HTTP {resp.status}: {message}")
                    return body
            except (*retryable, _Retry) as exc:
                if attempt == attempts:
                    raise _failure(method, path, exc) from exc
                if attempt == 1:
                    log.warning("%s %s failed (%s); retrying up to %d times", method, url, _describe(exc),
                                attempts - 1)
                await asyncio.sleep(BACKOFF_S * 2 ** (attempt - 1) * (0.5 + random.random()))
            except MAYBE_DONE as exc:  # not retryable for this request
                raise _failure(method, path, exc) from exc
        raise AssertionError("unreachable")

    async def health(self, attempts: int = MAX_ATTEMPTS) -> str:
        return await self._request("GET", "/", attempts=attempts)

    async def create(self) -> int:
        return int((await self._request("POST", "/create", json={}))["id"])

    async def reset(self, env_id: int, task_idx: int) -> str:
        return (await self._request("POST", "/reset", json={"id": env_id, "data_idx": task_idx}))["observation"]

    async def step(self, env_id: int, action: str) -> StepResult:
        body = await self._request("POST", "/step", json={"id": env_id, "action": action})
        return StepResult(body["observation"], float(body["reward"]), bool(body["done"]), body.get("info") or {})

    async def observation(self, env_id: int) -> str:
        return await self._request("GET", "/observation", params={"id": str(env_id)})

    async def close(self, env_id: int) -> bool:
        return bool(await self._request("POST", "/close", json={"id": env_id}))

    async def close_quietly(self, env_id: int) -> None:
        """Free an env at the end of an episode, once, without failing it: a server that is
        gone has nothing to free, and servers free idle envs on their own."""
        try:
            await self._request("POST", "/close", attempts=1, json={"id": env_id})
        except EnvError as exc:
            log.debug("close of env %d failed: %s", env_id, exc)


class _Retry(Exception):
    pass


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _failure(method: str, path: str, exc: BaseException) -> EnvError:
    if isinstance(exc, asyncio.TimeoutError):
        return EnvTimeout(f"{method} {path}: no answer within the timeout")
    return EnvUnreachable(f"{method} {path}: {_describe(exc)}")
