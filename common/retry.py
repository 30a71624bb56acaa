"""The one retry policy, the one wait for a server that is starting, and the one pause that a
stop event ends early.

A policy declares which exceptions are retried, its bound (attempts, a time limit, or both),
backoff with jitter, a log line on the first and every Nth retry, and re-raises the last
error at the end (arq's `connections.py`). `run` retries a coroutine, `call` a plain call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    retryable: tuple[type[BaseException], ...]
    """Exceptions worth another try; every other one propagates at once."""
    attempts: int | None = 60
    """Tries at most (None: bounded by timeout_s alone)."""
    timeout_s: float | None = None
    """No new try once this long has passed since the first (None: bounded by attempts alone)."""
    base_delay_s: float = 0.1
    """Delay after the first failure; it doubles with each one, up to max_delay_s, times a jitter of 0.5-1.5."""
    max_delay_s: float = 2.0
    log_every: int = 10
    """A warning on the first retry and every log_every-th; an error on giving up after a retry."""
    logger: logging.Logger | None = log
    """Where those lines go; None: nowhere (the caller reports the outcome itself)."""
    retry_if: Callable[[BaseException], bool] | None = None
    """A further test of a retryable exception (preflight retries only a failure marked transient)."""

    def __post_init__(self) -> None:
        if self.attempts is None and self.timeout_s is None:
            raise ValueError("a retry policy needs a bound: attempts, timeout_s or both")

    def delay(self, attempt: int) -> float:
        return min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1)) * (0.5 + random.random())

    async def run(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        started = time.monotonic()
        for attempt in itertools.count(1):  # bounded in _again
            try:
                result = await call()
            except self.retryable as exc:
                if not self._again(what, attempt, exc, started):
                    raise
                await asyncio.sleep(self.delay(attempt))
            else:
                self._succeeded(what, attempt)
                return result

    def call(self, what: str, call: Callable[[], T]) -> T:
        started = time.monotonic()
        for attempt in itertools.count(1):  # bounded in _again
            try:
                result = call()
            except self.retryable as exc:
                if not self._again(what, attempt, exc, started):
                    raise
                time.sleep(self.delay(attempt))
            else:
                self._succeeded(what, attempt)
                return result

    def _again(self, what: str, attempt: int, exc: BaseException, started: float) -> bool:
        """Whether `exc`, which ended try number `attempt`, is worth another try (logged)."""
        if self.retry_if is not None and not self.retry_if(exc):
            return False
        if ((self.attempts is not None and attempt >= self.attempts)
                or (self.timeout_s is not None and time.monotonic() - started >= self.timeout_s)):
            if self.logger is not None and attempt > 1:
                self.logger.error("%s failed %d times; giving up: %s", what, attempt, exc)
            return False
        if self.logger is not None and (attempt == 1 or attempt % self.log_every == 0):
            bound = f"of {self.attempts - 1}" if self.attempts is not None else f"within {self.timeout_s:g}s"
            self.logger.warning("%s failed (%s: %s); retry %d %s", what, type(exc).__name__, exc, attempt, bound)
        return True

    def _succeeded(self, what: str, attempt: int) -> None:
        if self.logger is not None and attempt > 1:
            self.logger.info("%s succeeded after %d attempts", what, attempt)


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until `event` is set or `timeout_s` has passed; True if it is set. A loop's pause
    that its stop event ends early. Unlike `asyncio.wait_for(event.wait(), timeout_s)` on Python
    3.11, a cancellation that meets the event's setting is raised, not dropped (CPython gh-86296;
    broker/connection.py's `cancel_safe` is the same for Redis calls)."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((waiter,), timeout=timeout_s)
    finally:
        waiter.cancel()
    return event.is_set()


def wait_until_up(probe: Callable[[], object], what: str, timeout_s: float, interval_s: float = 0.2,
                  exit_code: Callable[[], int | None] | None = None) -> None:
    """Call `probe` until it returns; an OSError from it means "not up yet". TimeoutError
    naming `what` once `timeout_s` has passed; RuntimeError at once when `exit_code()` (the
    server's process) says it has exited."""
    def attempt() -> None:
        code = exit_code() if exit_code is not None else None
        if code is not None:
            raise RuntimeError(f"{what} exited with code {code}")
        probe()

    policy = RetryPolicy((OSError,), attempts=None, timeout_s=timeout_s, base_delay_s=interval_s,
                         max_delay_s=interval_s, logger=None)
    try:
        policy.call(what, attempt)
    except OSError as exc:  # TimeoutError is an OSError too
        raise TimeoutError(f"{what} did not answer within {timeout_s:g}s ({type(exc).__name__}: {exc})") from exc


def wait_http(url: str, timeout_s: float = 60.0, exit_code: Callable[[], int | None] | None = None) -> None:
    """`wait_until_up` for an HTTP server: until GET `url` answers."""
    def get() -> None:
        with urllib.request.urlopen(url, timeout=1):
            pass

    wait_until_up(get, f"the server at {url}", timeout_s, 0.2, exit_code)
