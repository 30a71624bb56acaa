"""The retry policy of Redis commands: common/retry.py's, retrying what a Redis restart or a
network fault raises."""

from __future__ import annotations

import dataclasses
import logging

from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

from common.retry import RetryPolicy as _Policy

# What a Redis restart or a network fault raises; everything else propagates at once.
REDIS_TRANSIENT: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, BusyLoadingError, OSError)


@dataclasses.dataclass(frozen=True)
class RetryPolicy(_Policy):
    retryable: tuple[type[BaseException], ...] = REDIS_TRANSIENT
    logger: logging.Logger | None = logging.getLogger(__name__)
