"""Evaluation on held-out tasks: a policy plays the test split, and the success rate and the
mean reward come with 95% confidence intervals (Wilson for the rate, normal for the mean).
With several episodes a task (`samples`, sampled rather than greedy), the success rate is
pass@1 estimated over them, and its interval accounts for the clustering by task: the tasks,
not the episodes, are the independent draws (the normal interval of the tasks' own rates).

Policies: `model` (the engine, greedy by default), `oracle` and `random` (our env servers'
/oracle and /random: the ceiling and the floor to read a model's figures against).
Used by `omrl eval` and, every `learner.eval_every` versions, by the evaluator role (actors/evaluator.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
from array import array
from collections.abc import Awaitable, Callable, Sequence

from actors.choices import Choices
from actors.engine import Engine, Generation
from actors.episode import EpisodeSetup, Policy, Turn, run_episode
from common.messages import Sample
from envs.base import EpisodeError

Z95 = 1.959964


class PinnedModelPolicy:
    """The engine at a fixed temperature, on the weight version the caller holds (the caller
    keeps the weight gate for the whole evaluation, so every episode runs on one version)."""

    uses_choices = True

    def __init__(self, engine: Engine, version: int, temperature: float = 0.0):
        self.engine, self.version, self.temperature = engine, version, temperature

    async def act(self, tokens: list[int], budget: int, env_id: int, stops: list[str] | None = None,
                  choices: Choices | None = None) -> Turn:
        return Turn(await self.engine.generate(tokens, budget, self.temperature, stops=stops, choices=choices),
                    self.version)


class ServerPolicy:
    """The env server's own policy (`oracle` or `random`): the action comes from the server; its
    text goes into the token buffer as if generated (log-prob 0, version -1).

    `noise`: the share of the oracle's turns where a mistake takes their place, outside the loss
    mask (Turn.trained): the episodes then show the oracle recovering from mistakes, the states a
    model that learned from clean episodes alone never saw. The oracle plans from the state it
    finds, so it recovers. The mistakes are the env's (`mistake_action`: a random action unless
    the env has a typical mistake), or with `mistakes` a policy's own turns (a model sampling):
    then the oracle's turns label the states that policy reaches, DAgger's data (Ross et al.
    2011, with the policy and the oracle mixed turn by turn). Whether a turn is a mistake depends
    on `seed` and the episode's tokens so far alone (and the server draws an episode's mistakes
    from its task's own seed), so the same seed collects the same episodes whatever order
    concurrent episodes take their turns in (a sampling model's turns aside)."""

    def __init__(self, setup: EpisodeSetup, kind: str, noise: float = 0.0, seed: int = 0,
                 mistakes: Policy | None = None):
        if kind not in ("oracle", "random"):
            raise ValueError(f"unknown server policy {kind!r}: oracle or random")
        check_noise(noise)
        self.setup, self.kind, self.noise, self.seed, self.mistakes = setup, kind, noise, seed, mistakes
        self.uses_choices = mistakes is not None  # a model's turns among the oracle's (DAgger's data)

    async def act(self, tokens: list[int], budget: int, env_id: int, stops: list[str] | None = None,
                  choices: Choices | None = None) -> Turn:
        env = self.setup.env
        noisy = self.kind == "oracle" and self.noise > 0 and self._draw(tokens) < self.noise
        if noisy and self.mistakes is not None:
            return dataclasses.replace(await self.mistakes.act(tokens, budget, env_id, stops, choices), trained=False)
        if noisy:
            action = await env.mistake_action(env_id)
        else:
            action = await (env.random_action(env_id) if self.kind == "random" else env.oracle_action(env_id))
        ids = self.setup.format.agent_turn(action)
        return Turn(Generation(ids, [0.0] * len(ids), "stop"), -1, action=action, trained=not noisy)

    def _draw(self, tokens: list[int]) -> float:
        """A uniform draw in [0, 1) fixed by the seed and the episode's tokens so far."""
        digest = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8,
                                 key=self.seed.to_bytes(8, "little", signed=True)).digest()
        return int.from_bytes(digest, "little") / 2 ** 64


def check_noise(noise: float) -> None:
    """ServerPolicy's `noise` is a share of the turns: in [0, 1) (1 would leave no oracle turn)."""
    if not 0 <= noise < 1:
        raise ValueError(f"noise must be in [0, 1), got {noise}")


@dataclasses.dataclass
class EvalResult:
    env: str
    policy: str
    episodes: int
    success: float
    success_ci: tuple[float, float]
    reward: float
    reward_ci: tuple[float, float]
    invalid_action_frac: float
    turns: float
    per_task: dict[int, float] | None = None  # each task's success rate, where it had several episodes

    @classmethod
    def of(cls, env: str, policy: str, episodes: Sequence[Sequence[Sample]],
           tasks: Sequence[int] | None = None) -> EvalResult:
        """Each episode as its samples: the episode loop's one, or an agent's segments; `tasks`,
        each episode's task, where a task had several (the interval is then clustered by task)."""
        n = len(episodes)
        wins = sum(e[0].success for e in episodes)
        rewards = [e[0].reward for e in episodes]
        mean, half = _mean_half(rewards)
        turns = sum(s.num_turns for e in episodes for s in e)
        success, success_ci, per_task = wins / n, wilson(wins, n), None
        if tasks is not None and len(set(tasks)) < len(tasks):
            per_task = task_rates(tasks, [e[0].success for e in episodes])
            success, success_ci = clustered(per_task)
        return cls(env, policy, n, success, success_ci, mean, (mean - half, mean + half),
                   sum(s.invalid_actions for e in episodes for s in e) / max(1, turns), turns / n, per_task)

    def row(self) -> str:
        return (f"{self.env:<14} {self.policy:<7} {self.episodes:>8}  {self.success:5.3f} "
                f"[{self.success_ci[0]:.3f}, {self.success_ci[1]:.3f}]  {self.reward:6.3f} "
                f"[{self.reward_ci[0]:.3f}, {self.reward_ci[1]:.3f}]  {self.invalid_action_frac:6.3f}")


TABLE_HEADER = (f"{'env':<14} {'policy':<7} {'episodes':>8}  {'success [95% CI]':<22} {'reward [95% CI]':<24} "
                f"invalid")


def _mean_half(values: Sequence[float]) -> tuple[float, float]:
    """The mean and the half-width of its normal 95% interval."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, Z95 * sd / math.sqrt(n)


def task_rates(tasks: Sequence[int], successes: Sequence[bool]) -> dict[int, float]:
    """Each task's success rate over its episodes."""
    wins: dict[int, list[bool]] = {}
    for task, success in zip(tasks, successes, strict=True):
        wins.setdefault(task, []).append(bool(success))
    return {task: sum(w) / len(w) for task, w in wins.items()}


def clustered(per_task: dict[int, float]) -> tuple[float, tuple[float, float]]:
    """pass@1 over tasks played several times each (the mean of their rates) and its 95%
    interval with the tasks as the independent draws (clipped to [0, 1])."""
    mean, half = _mean_half(list(per_task.values()))
    return mean, (max(0.0, mean - half), min(1.0, mean + half))


def wilson(wins: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a success rate."""
    if n == 0:
        return (0.0, 1.0)
    p = wins / n
    denom = 1 + Z95 ** 2 / n
    centre = (p + Z95 ** 2 / (2 * n)) / denom
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


async def evaluate(setup: EpisodeSetup, policy: Policy, tasks: Sequence[int], policy_name: str,
                   concurrency: int = 64, progress: Callable[[], None] | None = None,
                   play: Callable[[int], Awaitable[list[Sample]]] | None = None, samples: int = 1) -> EvalResult:
    """`samples` episodes per task (several are for a sampling policy: pass@1 clustered by
    task), at most `concurrency` at once, `progress()` after each; an env, agent or reward
    failure raises (EpisodeError). `play`: an episode of a task as its samples (your agent's:
    actors/agents.py) in place of the episode loop's with `policy`."""
    if not tasks:
        raise ValueError("no tasks to evaluate")
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    played = [task for task in tasks for _ in range(samples)]
    limit = asyncio.Semaphore(concurrency)

    async def one(task_idx: int) -> list[Sample]:
        async with limit:
            samples = await play(task_idx) if play is not None else [await run_episode(setup, policy, task_idx)]
        if progress is not None:
            progress()
        return samples

    try:
        async with asyncio.TaskGroup() as tg:
            episodes = [tg.create_task(one(t)) for t in played]
    except* EpisodeError as errors:  # the first failure cancels the rest
        raise errors.exceptions[0] from None
    return EvalResult.of(setup.env_name, policy_name, [e.result() for e in episodes], played if samples > 1 else None)
