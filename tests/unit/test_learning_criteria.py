"""The e2e tests' learning criterion (tests/e2e/learning.py) can fail, and for the right reason:
a flat, noisy curve's best window beats its first fifth by many standard errors of one window,
but not by more than random orders of its steps do; a learning curve beats all of them."""

import numpy as np

from tests.e2e.learning import fifths


def curve(values) -> list[dict]:
    return [{"r": float(v)} for v in values]


def test_the_best_window_of_a_flat_curve_is_no_evidence_of_learning():
    rng = np.random.default_rng(0)
    flat = [fifths(curve(rng.normal(0.3, 0.1, 160)), "r", best=True) for _ in range(20)]
    # One window's standard error calls several of these a gain (2 se, one in 44 were it honest).
    assert sum(f.gain > 2 * f.stderr for f in flat) >= 3
    assert sum(f.p < 0.01 for f in flat) <= 2  # the permutation test knows the choice was made (0.2 expected)


def test_a_learning_curve_passes_whether_it_ends_high_or_falls_back():
    rng = np.random.default_rng(1)
    rise = np.clip(np.linspace(0.1, 0.8, 160) + rng.normal(0, 0.1, 160), 0, 1)
    assert fifths(curve(rise), "r").p < 0.001 and fifths(curve(rise), "r", best=True).p < 0.001
    fallback = np.concatenate([rise[:120], rng.normal(0.1, 0.05, 40)])  # learned, then collapsed
    assert fifths(curve(fallback), "r", best=True).p < 0.001
    assert fifths(curve(fallback), "r").p > 0.001  # its last fifth alone shows no gain
