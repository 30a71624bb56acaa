"""Named timing sections: `with timer("forward"): ...`, then `timer.pop()` for the totals."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator


class Timer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - start

    def pop(self, prefix: str = "time/") -> dict[str, float]:
        out = {f"{prefix}{k}_s": v for k, v in self.totals.items()}
        self.totals.clear()
        return out
