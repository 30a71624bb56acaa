"""`calculator`: a product too hard to guess, a calculator tool, and one answer.

Each task (seeded by its index) is a product `a*b` of two numbers in 2..`top`, shown as
`37*12=`. An action starting with `c` calls the calculator, which answers with the product
(`444`); an action starting with a digit answers with its leading digits, which ends the
episode. Calling the calculator earns `call_reward` once; the answer earns the rest
(1 - call_reward) times the fraction of its digits in the right place, so the exact
product earns it all. Anything else is answered `?`. The tool's output is the way to the
answer: the model has to call it and copy what it says. (Actions are read by their start,
so that a model learning from scratch finds the two actions often enough to learn them.)
"""

from __future__ import annotations

import random
import re

from envs.base import Env, StepResult, register_env


@register_env("calculator")
class CalculatorEnv(Env):
    blocking = False  # pure Python, quick: served on the event loop

    def __init__(self, top: int = 99, turns: int = 3, call_reward: float = 0.2):
        if not 2 <= top <= 999:
            raise ValueError("calculator: top must be in 2..999")
        if not 0 <= call_reward < 1:
            raise ValueError("calculator: call_reward must be in [0, 1)")
        self.top, self.turns, self.call_reward = top, turns, call_reward
        self.a = self.b = 0
        self.called, self.turn, self.done = False, 0, True
        self.last = ""

    @property
    def answer(self) -> str:
        return str(self.a * self.b)

    def reset(self, task_idx: int) -> str:
        rng = random.Random(task_idx)
        self.a, self.b = rng.randint(2, self.top), rng.randint(2, self.top)
        self.called, self.turn, self.done = False, 0, False
        self.last = f"{self.a}*{self.b}="
        return self.last

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("step after the episode ended")
        self.turn += 1
        text = action.strip()
        if text[:1].isdigit():
            text = re.match(r"[0-9]+", text).group()
            self.done, self.last = True, ""
            right = sum(x == y for x, y in zip(text, self.answer)) / max(len(text), len(self.answer))
            return StepResult("", (1.0 - self.call_reward) * right, True, {"success": text == self.answer})
        reward = 0.0
        if text.startswith("c"):
            reward, self.called = (0.0 if self.called else self.call_reward), True
            self.last = self.answer
        else:
            self.last = "?"
        self.done = self.turn >= self.turns
        return StepResult(self.last, reward, self.done, {"success": False})

    def observation(self) -> str:
        return self.last

    def oracle_action(self) -> str:
        return self.answer if self.called else "c"

    def random_action(self, rng: random.Random) -> str:
        return "c" if rng.random() < 0.5 else str(rng.randint(4, self.top * self.top))
