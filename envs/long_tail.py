"""`long_tail`: answers whose length follows a heavy-tailed law, as reasoning and agent
outputs do, for measuring what asynchrony buys (`omrl bench pipeline`).

Task i (seeded by i) asks for `length` copies of one letter, `length` drawn from a discrete
Pareto law: `floor(U ** (-1 / alpha))` capped at `max_len`, U uniform in (0, 1]. With
alpha = 1 half the tasks want 1 letter, one in eight at least 8, one in 32 at least 32:
most groups finish after one short turn, a few run many turns. The answer comes in turns;
each shows ``Say x`` and counts every character written (at least one a turn, so an
episode takes at most `length` turns); the episode ends once `length` characters are
written. The reward is the share of those `length` characters that are the letter, paid
as they come, so an episode's rewards sum to a value in [0, 1]. Like `letters`, the
observation ends in the letter: a tiny model learns it from random initialisation.
"""

from __future__ import annotations

import random

from envs.base import Env, StepResult, register_env


def answer_length(task_idx: int, alpha: float, max_len: int) -> int:
    """The task's length: discrete Pareto with tail index alpha, in 1..max_len."""
    u = 1.0 - random.Random(f"long_tail-{task_idx}").random()  # (0, 1]
    return min(max_len, int(u ** (-1.0 / alpha)))


@register_env("long_tail")
class LongTailEnv(Env):
    blocking = False  # pure Python, quick: served on the event loop

    def __init__(self, alpha: float = 1.0, max_len: int = 64, alphabet: str = "abcd"):
        if alpha <= 0:
            raise ValueError("long_tail: alpha must be positive (smaller: heavier tail)")
        if max_len < 1:
            raise ValueError("long_tail: max_len must be at least 1")
        if not alphabet:
            raise ValueError("long_tail: alphabet must not be empty")
        self.alpha, self.max_len, self.alphabet = alpha, max_len, alphabet
        self.letter, self.length, self.written, self.right = "", 0, 0, 0

    def reset(self, task_idx: int) -> str:
        self.letter = random.Random(task_idx).choice(self.alphabet)
        self.length, self.written, self.right = answer_length(task_idx, self.alpha, self.max_len), 0, 0
        return self.observation()

    def observation(self) -> str:
        return f"Say {self.letter}" if self.written < self.length else ""

    def step(self, action: str) -> StepResult:
        if not self.length:
            raise RuntimeError("step before reset")
        if self.written >= self.length:
            raise RuntimeError("step after the episode ended")
        answer = action.strip()[:self.length - self.written]
        right = sum(ch == self.letter for ch in answer)
        self.written += max(1, len(answer))
        self.right += right
        done = self.written >= self.length
        return StepResult("\n" + self.observation(), right / self.length, done,
                          {"success": done and self.right == self.length})

    def oracle_action(self) -> str:
        return self.letter * (self.length - self.written)

    def random_action(self, rng: random.Random) -> str:
        return rng.choice(self.alphabet)
