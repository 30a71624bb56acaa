"""Reward functions by name. An episode's reward is the weighted sum of the functions named
in `actor.rewards` (default `{env = 1.0}`); the per-turn env rewards travel in the message
beside it. Adding one is a function and a decorator::

    @register_reward("short_answers")
    def short_answers(episode: Episode) -> float:
        return 1.0 - episode.generated_tokens / max(1, episode.token_budget)

then `--set 'actor.rewards={env = 1.0, short_answers = 0.1}'`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass
class Episode:
    """What a reward function sees of one finished episode."""

    turn_rewards: list[float]  # the env's reward of each turn (0 for an invalid action)
    valid_actions: list[bool]  # per turn: the action parsed by the action template
    success: bool  # the env's success rule (envs.specs)
    generated_tokens: int
    token_budget: int  # the most tokens the episode could have generated
    finish_reason: str  # done, max_turns, context


RewardFn = Callable[[Episode], float]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward function {name!r} is registered twice")
        REWARDS[name] = fn
        return fn
    return deco


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


@register_reward("length")
def length_penalty(episode: Episode) -> float:
    """Minus the fraction of the token budget the episode used: weight it small and positive."""
    return -episode.generated_tokens / max(1, episode.token_budget)


def check_weights(weights: dict[str, float]) -> None:
    unknown = sorted(set(weights) - set(REWARDS))
    if unknown:
        raise ValueError(f"unknown reward functions {unknown} in actor.rewards: choose from {sorted(REWARDS)}")


def combine(weights: dict[str, float], episode: Episode) -> float:
    return float(sum(w * REWARDS[name](episode) for name, w in weights.items()))
