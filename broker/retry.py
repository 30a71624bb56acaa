"""A declared retry policy: which exceptions are retried, how many attempts, backoff with
jitter, a log line on the first and every Nth retry, and the error re-raised at the end."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from typing import Awaitable, Callable, TypeVar

from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

log = logging.getLogger(__name__)
T = TypeVar("T")

# What a Redis restart or a network fault raises; everything else propagates at once.
REDIS_TRANSIENT: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, BusyLoadingError, OSError)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    retryable: tuple[type[BaseException], ...] = REDIS_TRANSIENT
    attempts: int = 60
    base_delay_s: float = 0.1
    max_delay_s: float = 2.0
    log_every: int = 10

    def delay(self, attempt: int) -> float:
        return min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1)) * (0.5 + random.random())

    async def run(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                result = await call()
            except self.retryable as exc:
                if attempt == self.attempts:
                    log.error("%s failed %d times; giving up: %s", what, attempt, exc)
                    raise
                if attempt == 1 or attempt % self.log_every == 0:
                    log.warning("%s failed (%s: %s); retry %d of %d", what, type(exc).__name__, exc,
                                attempt, self.attempts - 1)
                await asyncio.sleep(self.delay(attempt))
            else:
                if attempt > 1:
                    log.info("%s succeeded after %d attempts", what, attempt)
                return result
        raise AssertionError("unreachable")
