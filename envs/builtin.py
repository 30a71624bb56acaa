"""Built-in envs."""

from __future__ import annotations

import random

from envs.base import Env, StepResult, register_env


@register_env("letters")
class LettersEnv(Env):
    """Multi-turn 'say the letter': each turn shows ``Say x`` and the answer earns the
    fraction of its characters equal to x (its line ending aside), divided by the number
    of turns, so an episode's rewards sum to a value in [0, 1]. Task i fixes the letters.

    A tiny model learns it from random initialisation in minutes: the prompt ends with the
    letter, so the model must learn to continue a letter with itself, and to stop.
    """

    blocking = False  # pure Python, quick: served on the event loop

    def __init__(self, turns: int = 2, alphabet: str = "abcd"):
        if turns < 1:
            raise ValueError("letters: turns must be at least 1")
        if not alphabet:
            raise ValueError("letters: alphabet must not be empty")
        self.turns, self.alphabet = turns, alphabet
        self.targets: list[str] = []
        self.turn = 0

    def _prompt(self) -> str:
        return f"Say {self.targets[self.turn]}"

    def reset(self, task_idx: int) -> str:
        rng = random.Random(task_idx)
        self.targets = [rng.choice(self.alphabet) for _ in range(self.turns)]
        self.turn, self.total = 0, 0.0
        return self._prompt()

    @staticmethod
    def score(answer: str, target: str) -> float:
        answer = answer.strip()
        return sum(ch == target for ch in answer) / len(answer) if answer else 0.0

    def step(self, action: str) -> StepResult:
        if not self.targets:
            raise RuntimeError("step before reset")
        if self.turn >= self.turns:
            raise RuntimeError("step after the episode ended")
        reward = self.score(action, self.targets[self.turn]) / self.turns
        self.turn += 1
        self.total += reward
        done = self.turn >= self.turns
        return StepResult("\n" + ("" if done else self._prompt()), reward, done,
                          {"success": done and self.total >= 1.0 - 1e-6})

    def observation(self) -> str:
        return self._prompt() if self.targets and self.turn < self.turns else ""

    def oracle_action(self) -> str:
        return self.targets[self.turn]

    def random_action(self, rng: random.Random) -> str:
        return rng.choice(self.alphabet)

    def actions(self) -> list[str]:
        return list(self.alphabet)


# The suite of small envs that need their observations (one module each).
import envs.babyai  # noqa: E402,F401
import envs.calculator  # noqa: E402,F401
import envs.grid_nav  # noqa: E402,F401
import envs.guess_number  # noqa: E402,F401
import envs.long_tail  # noqa: E402,F401
import envs.sciworld  # noqa: E402,F401
import envs.textcraft  # noqa: E402,F401
import envs.word_guess  # noqa: E402,F401
