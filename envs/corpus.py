"""The text an env speaks, for building a tokenizer from it (`omrl init-model --tokenizer word
--env NAME`): the observations and actions of episodes on its training tasks, played in this
process by the env's oracle and its random policy (whichever it has), with the text every
episode's context adds (the messages our episode loop writes around the env's own).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from envs.base import make_env

EXTRA_TEXT = ("Invalid Action.\n\n", "S: ", "U: ", "check available actions")
"""Text the episode loop and the tiny chat template add to what envs say."""


def env_texts(name: str, tasks: Sequence[int], episodes: int = 200, max_turns: int = 20, seed: int = 0,
              options: dict | None = None) -> Iterator[str]:
    """Observations and actions of `episodes` episodes on tasks drawn from `tasks`: each policy the
    env has (oracle, random) plays half of them, each for at most `max_turns` actions."""
    rng = random.Random(seed)
    env = make_env(name, **(options or {}))
    try:
        policies = [p for p in ("oracle", "random") if _has(env, p, tasks[0])]
        if not policies:
            raise ValueError(f"env {name!r} has neither an oracle nor a random policy to gather its text with")
        yield from EXTRA_TEXT
        for i in range(episodes):
            policy = policies[i % len(policies)]
            yield env.reset(rng.choice(tasks))
            for _turn in range(max_turns):
                action = env.oracle_action() if policy == "oracle" else env.random_action(rng)
                yield action
                result = env.step(action)
                yield result.observation
                if result.done:
                    break
    finally:
        env.close()


def _has(env, policy: str, task: int) -> bool:
    env.reset(task)
    try:
        env.oracle_action() if policy == "oracle" else env.random_action(random.Random(0))
    except NotImplementedError:
        return False
    return True
