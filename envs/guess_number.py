"""`guess_number`: find a secret number with higher/lower feedback.

Each task (seeded by its index) hides a number in 1..`high`. The first observation is
`1-8?`; each guess (a number) is answered `<` (the secret is lower), `>` (higher) or `=`
(found, the episode ends). Finding it at turn t earns `1 - penalty * (t - 1)` (never below
0.1); not finding it within `turns` guesses earns 0. The feedback is what makes it
solvable: without it the best fixed sequence of guesses finds the secret about half as
often as the oracle's binary search, which always finds it in at most ceil(log2 high) + 1
guesses.
"""

from __future__ import annotations

import random

from envs.base import Env, StepResult, register_env


@register_env("guess_number")
class GuessNumberEnv(Env):
    blocking = False  # pure Python, quick: served on the event loop

    def __init__(self, high: int = 8, turns: int = 4, penalty: float = 0.2):
        if not 2 <= high <= 99:
            raise ValueError("guess_number: high must be in 2..99")
        if turns < 1:
            raise ValueError("guess_number: turns must be at least 1")
        self.high, self.turns, self.penalty = high, turns, penalty
        self.secret = 0
        self.lo, self.hi = 1, high  # what the feedback so far allows (the oracle's interval)
        self.turn = 0
        self.done = True
        self.last = ""

    def reset(self, task_idx: int) -> str:
        self.secret = random.Random(task_idx).randint(1, self.high)
        self.lo, self.hi, self.turn, self.done = 1, self.high, 0, False
        self.last = f"1-{self.high}?"
        return self.last

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("step after the episode ended")
        self.turn += 1
        text = action.strip()
        guess = int(text) if text.isdigit() else None
        if guess == self.secret:
            self.done = True
            self.last = "="
            return StepResult(self.last, max(0.1, 1.0 - self.penalty * (self.turn - 1)), True, {"success": True})
        if guess is not None and guess < self.secret:
            self.lo = max(self.lo, guess + 1)
            self.last = ">"
        elif guess is not None:
            self.hi = min(self.hi, guess - 1)
            self.last = "<"
        else:
            self.last = "?"
        self.done = self.turn >= self.turns
        return StepResult(self.last, 0.0, self.done, {"success": False})

    def observation(self) -> str:
        return self.last

    def oracle_action(self) -> str:
        return str((self.lo + self.hi) // 2)

    def random_action(self, rng: random.Random) -> str:
        return str(rng.randint(1, self.high))
