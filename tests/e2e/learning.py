"""What e2e tests read from a run: the first fifth of a metric over the steps against the last
fifth (or the best window of as many consecutive steps), and how likely a gain that large is
without any learning.

The best window is chosen after the fact, so one window's standard error says nothing of
it: the best of some 130 windows of a flat, noisy curve beats its first fifth by several of
them. `p` is a permutation test that makes the same choice: under no learning the steps'
values are exchangeable, so the gain is compared with the gains of the same values in
random orders, each judged the same way (best window, or last fifth, against the first).
Exchangeability is the null's assumption: a curve that drifts without learning (steps
correlated with their neighbours) would look less likely than it is, so the tests keep an
absolute bar on the gain besides p."""

from __future__ import annotations

import dataclasses

import numpy as np

PERMUTATIONS = 10_000


@dataclasses.dataclass
class Fifths:
    first: float  # mean over the first fifth of the steps
    last: float  # mean over the last fifth (or the best run of as many consecutive steps)
    stderr: float  # standard error of last - first from the step-to-step spread (one fixed window's)
    p: float  # the share of random orders of the same values whose gain is at least as large

    @property
    def gain(self) -> float:
        return self.last - self.first

    def __str__(self) -> str:
        return (f"first fifth {self.first:.3f}, then {self.last:.3f}, gain {self.gain:.3f} (se {self.stderr:.3f}, "
                f"permutation p {self.p:.4f})")


def _gains(values: np.ndarray, k: int, best: bool) -> np.ndarray:
    """Per row of `values` (orders of the steps): the best (or last) k-window mean less the first's."""
    c = np.concatenate([np.zeros((values.shape[0], 1)), np.cumsum(values, axis=1)], axis=1)
    windows = (c[:, k:] - c[:, :-k]) / k  # every window's mean, by start
    return (windows.max(axis=1) if best else windows[:, -1]) - windows[:, 0]


def fifths(rows: list[dict], key: str, best: bool = False, seed: int = 0) -> Fifths:
    """The first fifth of the steps against the last fifth, or against the best run of as many
    consecutive steps (`best`: what the run reached, where its end may have fallen back)."""
    values = np.array([r[key] for r in rows], dtype=float)
    k = len(values) // 5
    gain = float(_gains(values[None], k, best)[0])
    shuffled = np.random.default_rng(seed).permuted(np.tile(values, (PERMUTATIONS, 1)), axis=1)
    p = (1 + int((_gains(shuffled, k, best) >= gain - 1e-12).sum())) / (1 + PERMUTATIONS)
    first = values[:k]
    c = np.concatenate([[0.0], np.cumsum(values)])
    means = (c[k:] - c[:-k]) / k
    start = int(means.argmax()) if best else len(values) - k
    last = values[start:start + k]
    stderr = float(np.sqrt(first.var(ddof=1) / k + last.var(ddof=1) / k))
    return Fifths(float(first.mean()), float(last.mean()), stderr, p)
