"""The limits every HTTP server of ours puts on slow clients (aiohttp): the env server, an
actor's OpenAI-compatible endpoint and `omrl view`. A connection idle, or still sending its
request's head, for KEEPALIVE_S is closed; a request's body must arrive within
BODY_TIMEOUT_S (each server answers 408 in its own error shape). Slow or silent clients so
hold no connection and no handler for long, and the others are served beside them."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

BODY_TIMEOUT_S = 30.0
KEEPALIVE_S = 75.0


def runner_for(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """The app's runner, with KEEPALIVE_S and no access log (`kwargs`: aiohttp's others)."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_S, **kwargs)


async def read_body(request: web.Request) -> bytes:
    """The request's body; TimeoutError, saying so, where it has not all arrived within
    BODY_TIMEOUT_S (each server answers 408 with that message)."""
    try:
        return await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except TimeoutError:
        raise TimeoutError(f"the request's body did not arrive within {BODY_TIMEOUT_S:g}s") from None
