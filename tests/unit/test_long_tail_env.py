"""`long_tail`: answer lengths follow a heavy-tailed law (the pipeline benchmark's straggler
groups), an episode ends once the task's length is written, and the reward is the share of
right letters."""

import random

import numpy as np
import pytest

from envs.base import make_env
from envs.long_tail import answer_length


def test_lengths_are_heavy_tailed_and_fixed_per_task():
    lengths = np.array([answer_length(i, 1.0, 64) for i in range(20_000)])
    assert lengths.min() == 1 and lengths.max() == 64
    # Discrete Pareto, alpha = 1: P(L >= k) = 1/k below the cap.
    for k in (2, 8, 32):
        assert abs((lengths >= k).mean() - 1 / k) < 0.01, k
    assert [answer_length(i, 1.0, 64) for i in range(100)] == list(lengths[:100])
    heavier = np.array([answer_length(i, 0.5, 64) for i in range(20_000)])
    assert heavier.mean() > lengths.mean()


def play(task: int, policy) -> tuple[float, int, bool]:
    env = make_env("long_tail")
    observation = env.reset(task)
    assert observation.startswith("Say ")
    total, turns, done, info = 0.0, 0, False, {}
    while not done:
        result = env.step(policy(env))
        assert 0.0 <= result.reward <= 1.0
        total, turns, done, info = total + result.reward, turns + 1, result.done, result.info
    with pytest.raises(RuntimeError):
        env.step("a")
    return total, turns, info["success"]


def test_oracle_wins_in_one_turn_and_wrong_letters_earn_nothing():
    for task in range(200):
        env = make_env("long_tail")
        env.reset(task)
        letter, length = env.letter, env.length
        assert play(task, lambda e: e.oracle_action()) == (pytest.approx(1.0), 1, True)
        wrong = next(c for c in "abcd" if c != letter)
        assert play(task, lambda e: wrong * 4) == (0.0, -(-length // 4), False)


def test_every_turn_counts_at_least_one_letter_so_episodes_end():
    task = next(i for i in range(1000) if answer_length(i, 1.0, 64) >= 20)
    total, turns, _ = play(task, lambda e: "")
    assert total == 0.0 and turns == answer_length(task, 1.0, 64)
    rng = random.Random(0)
    total, turns, success = play(task, lambda e: e.random_action(rng))
    assert 0.0 < total < 0.6 and not success


def test_bad_options_are_refused():
    for options in ({"alpha": 0}, {"max_len": 0}, {"alphabet": ""}):
        with pytest.raises(ValueError):
            make_env("long_tail", **options)
