"""`word_guess`: find a short secret word from per-letter feedback (Wordle, made tiny).

Each task (seeded by its index) hides a word of `length` letters from `alphabet`. The first
observation is the word's length as dots (`..`); each guess is answered letter by letter:
`=` the letter is right there, `-` it is not. Each position earns `0.5 / length` the first
time it is marked `=`; finding the whole word at turn t earns another
`0.5 * (1 - penalty * (t - 1))` (at least 0.05), so an episode earns at most 1 and
partial progress counts. The feedback is what makes it solvable: keep the letters marked
`=`, change the others; a policy that ignores it does no better than guessing.
"""

from __future__ import annotations

import random

from envs.base import Env, StepResult, register_env


@register_env("word_guess")
class WordGuessEnv(Env):
    blocking = False  # pure Python, quick: served on the event loop

    def __init__(self, length: int = 2, alphabet: str = "abcd", turns: int = 5, penalty: float = 0.2):
        if not 1 <= length <= 6:
            raise ValueError("word_guess: length must be in 1..6")
        if len(set(alphabet)) < 2:
            raise ValueError("word_guess: the alphabet needs at least two letters")
        self.length, self.alphabet, self.turns, self.penalty = length, alphabet, turns, penalty
        self.secret = ""
        self.known: list[set[str]] = []  # per position: letters ruled out (the oracle's memory)
        self.found: set[int] = set()  # positions marked `=` so far
        self.turn, self.done = 0, True
        self.last = ""

    def reset(self, task_idx: int) -> str:
        rng = random.Random(task_idx)
        self.secret = "".join(rng.choice(self.alphabet) for _ in range(self.length))
        self.known = [set() for _ in range(self.length)]
        self.found = set()
        self.turn, self.done = 0, False
        self.last = "." * self.length
        return self.last

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("step after the episode ended")
        self.turn += 1
        guess = action.strip().lower()
        right = {i for i in range(self.length) if guess[i:i + 1] == self.secret[i]}
        reward = 0.5 * len(right - self.found) / self.length
        self.found |= right
        if guess == self.secret:
            self.done, self.last = True, "=" * self.length
            reward += 0.5 * max(0.1, 1.0 - self.penalty * (self.turn - 1))
            return StepResult(self.last, reward, True, {"success": True})
        marks = []
        for i in range(self.length):
            letter = guess[i] if i < len(guess) else ""
            if letter == self.secret[i]:
                marks.append("=")
            else:
                marks.append("-")
                if letter:
                    self.known[i].add(letter)
        self.last = "".join(marks)
        self.done = self.turn >= self.turns
        return StepResult(self.last, reward, self.done, {"success": False})

    def observation(self) -> str:
        return self.last

    def oracle_action(self) -> str:
        return "".join(self.secret[i] if self.last[i:i + 1] == "=" else
                       next(c for c in self.alphabet if c not in self.known[i]) for i in range(self.length))

    def random_action(self, rng: random.Random) -> str:
        return "".join(rng.choice(self.alphabet) for _ in range(self.length))
