"""Intervals over a few independent runs (seeds): the mean and its 95% t-interval."""

from __future__ import annotations

import statistics

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # t(0.975, df)


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval over seeds (a single seed: no interval)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    half = T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half
