"""What e2e tests read from a run: the first and the last (or best) fifth of a metric over the steps."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class Fifths:
    first: float  # mean over the first fifth of the steps
    last: float  # mean over the last fifth (or the best run of as many consecutive steps)
    stderr: float  # standard error of last - first, from the step-to-step spread

    @property
    def gain(self) -> float:
        return self.last - self.first

    def __str__(self) -> str:
        return f"first fifth {self.first:.3f}, then {self.last:.3f}, gain {self.gain:.3f} (se {self.stderr:.3f})"


def fifths(rows: list[dict], key: str, best: bool = False) -> Fifths:
    """The first fifth of the steps against the last fifth, or against the best run of as many
    consecutive steps (`best`: what the run reached, where its end may have fallen back)."""
    values = [r[key] for r in rows]
    k = len(values) // 5
    windows = [values[i:i + k] for i in range(len(values) - k + 1)] if best else [values[-k:]]
    first, last = values[:k], max(windows, key=sum)

    def mean(xs):
        return sum(xs) / len(xs)

    def var(xs):
        return sum((x - mean(xs)) ** 2 for x in xs) / (len(xs) - 1)
    return Fifths(mean(first), mean(last), math.sqrt(var(first) / k + var(last) / k))
