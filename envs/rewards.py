"""Reward functions by name. An episode's reward is the weighted sum of the functions named
in `actor.rewards` (default `{env = 1.0}`); the per-turn env rewards travel in the message
beside it. A reward function sees the whole episode: the task (with the task file's own
columns, such as an answer to check against), every turn's generated text, action,
observation, env reward and info. Adding one is a function and a decorator::

    @register_reward("exact_answer")
    def exact_answer(episode: Episode) -> float:
        last = episode.turns[-1].action if episode.turns else None
        return 1.0 if last is not None and last.strip() == episode.task.get("answer") else 0.0

then `--set 'actor.rewards={env = 1.0, exact_answer = 1.0}'` (in a module of your own: name
it in `run.plugins`). A function may be `async` (an LLM judge, a verifier service): it is
awaited for at most `actor.reward_timeout_s`. A function that raises, times out or returns
something that is not a finite number fails the episode's group with the reason
(`reward_error`, `reward_timeout`); it never becomes a reward of 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable
from typing import Any

from common.registry import Registry
from envs.base import EpisodeError


@dataclasses.dataclass
class EpisodeTurn:
    """One turn as the reward functions see it."""

    text: str  # what the model generated (special tokens left out)
    action: str | None  # what the action template read from it; None: it did not parse (no env call)
    observation: str  # the env's answer ("Invalid Action." and the last observation when it did not parse)
    reward: float  # the env's reward of this turn (0 for an invalid action)
    done: bool
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # the answer's other fields (score, success, ...)


@dataclasses.dataclass
class Episode:
    """What a reward function sees of one finished episode."""

    turns: list[EpisodeTurn]
    success: bool  # the env's success rule (envs.specs, env.spec)
    generated_tokens: int
    token_budget: int  # the most tokens the episode could have generated
    finish_reason: str  # done, max_turns, context
    task_idx: int = 0
    task: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The task file's other columns of this task (an `answer`, a `question`, ...); {} without a task file."""
    env_name: str = ""
    prompt: str = ""  # the env's first observation (the task as the agent saw it)

    @property
    def turn_rewards(self) -> list[float]:
        return [t.reward for t in self.turns]

    @property
    def valid_actions(self) -> list[bool]:
        return [t.action is not None for t in self.turns]


RewardFn = Callable[[Episode], "float | Awaitable[float]"]
REWARDS: Registry[RewardFn] = Registry("reward function", "actor.rewards")
register_reward = REWARDS.register


class RewardError(EpisodeError):
    """A reward function failed on an episode; its group fails with `reason`."""

    def __init__(self, message: str, reason: str = "reward_error"):
        super().__init__(message)
        self.reason = reason


@register_reward("env")
def env_reward(episode: Episode) -> float:
    """The sum of the env's rewards (AgentGym's outcome reward)."""
    return float(sum(episode.turn_rewards))


@register_reward("success")
def success(episode: Episode) -> float:
    """1 if the episode solved its task, else 0."""
    return 1.0 if episode.success else 0.0


@register_reward("format")
def action_format(episode: Episode) -> float:
    """The fraction of turns whose action parsed."""
    return sum(episode.valid_actions) / len(episode.valid_actions) if episode.valid_actions else 0.0


@register_reward("process")
def process(episode: Episode) -> float:
    """Per-turn credit: the fraction of turns that earned a positive env reward."""
    return sum(r > 0 for r in episode.turn_rewards) / len(episode.turn_rewards) if episode.turn_rewards else 0.0


@register_reward("progress")
def env_progress(episode: Episode) -> float:
    """The env's own measure of how far the episode got, from 0 to 1: `progress` in the last answer
    of the env (textcraft: the share of the goal's recipe tree the inventory has held); 0 where no
    action parsed. Partial credit that gives a spread to groups whose every episode fails."""
    answered = [turn for turn in episode.turns if turn.action is not None]
    if not answered:
        return 0.0
    value = answered[-1].info.get("progress")
    if value is None:
        raise RewardError(f"the progress reward needs an env that reports `progress` in its step answers; "
                          f"{episode.env_name or 'this env'} does not (textcraft does): take it out of actor.rewards")
    return float(value)


@register_reward("length")
def length_penalty(episode: Episode) -> float:
    """Minus the fraction of the token budget the episode used: weight it small and positive."""
    return -episode.generated_tokens / max(1, episode.token_budget)


def check_weights(weights: dict[str, float]) -> None:
    unknown = sorted(set(weights) - set(REWARDS))
    if unknown:
        raise ValueError(f"unknown reward functions {unknown} in actor.rewards: choose from {sorted(REWARDS)} "
                         f"(a function of your own: register it in a module named in run.plugins)")


async def _value(name: str, episode: Episode, timeout_s: float) -> float:
    where = f"reward function {name!r} on task {episode.task_idx}"
    try:
        value = REWARDS[name](episode)
        if inspect.isawaitable(value):
            value = await asyncio.wait_for(value, timeout_s)
    except TimeoutError:
        raise RewardError(f"{where} took longer than actor.reward_timeout_s={timeout_s}s", "reward_timeout") from None
    except Exception as exc:  # noqa: BLE001 - any failure of user code fails the group, with its text
        raise RewardError(f"{where} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(value, numbers.Real) or not math.isfinite(value):  # a bool counts as 0 or 1
        raise RewardError(f"{where} returned {value!r}, not a finite number")
    return float(value)


async def combine(weights: dict[str, float], episode: Episode, timeout_s: float = 60.0) -> float:
    """The weighted sum of the functions' values; the first failure raises `RewardError`."""
    try:
        async with asyncio.TaskGroup() as tg:
            values = [tg.create_task(_value(name, episode, timeout_s)) for name in weights]
    except* RewardError as errors:  # the first failure cancels the others
        raise errors.exceptions[0] from None
    return float(sum(w * v.result() for w, v in zip(weights.values(), values)))
