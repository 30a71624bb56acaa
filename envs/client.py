"""Async client for env servers speaking the AgentGym "id" protocol (ours or AgentGym's)."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import aiohttp

from envs.base import StepResult

log = logging.getLogger(__name__)

# Retry policy: what is retried, how often, and how long to back off.
RETRYABLE = (aiohttp.ClientConnectionError, asyncio.TimeoutError)
RETRY_STATUS = {503}
MAX_ATTEMPTS = 5
BACKOFF_S = 0.2


class EnvError(RuntimeError):
    """The env server refused a request; the text carries its error message."""


class EnvClient:
    def __init__(self, base_url: str, session: aiohttp.ClientSession, timeout_s: float = 300.0):
        self.base_url = base_url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        url = f"{self.base_url}{path}"
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                async with self.session.request(method, url, timeout=self.timeout, **kwargs) as resp:
                    if resp.status in RETRY_STATUS and attempt < MAX_ATTEMPTS:
                        raise _Retry(f"HTTP {resp.status}")
                    body = await resp.json(content_type=None)
                    if resp.status >= 400 or (isinstance(body, dict) and "error" in body):
                        message = body.get("error") if isinstance(body, dict) else body
                        raise EnvError(f"{method} {path}: HTTP {resp.status}: {message}")
                    return body
            except (*RETRYABLE, _Retry) as exc:
                if attempt == MAX_ATTEMPTS:
                    raise
                if attempt == 1:
                    log.warning("%s %s failed (%s); retrying up to %d times", method, url, exc, MAX_ATTEMPTS - 1)
                await asyncio.sleep(BACKOFF_S * 2 ** (attempt - 1) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    async def health(self) -> str:
        return await self._request("GET", "/")

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


class _Retry(Exception):
    pass
