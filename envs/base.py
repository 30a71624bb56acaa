"""What an environment is, and the registry that names the built-in ones.

Adding an env is a class with ``reset`` and ``step`` and one decorator::

    @register_env("my_env")
    class MyEnv(Env):
        def reset(self, task_idx: int) -> str: ...
        def step(self, action: str) -> StepResult: ...

Optional, each with a default: ``observation`` (the current observation), ``oracle_action``
(an expert's next action, for tests and oracle trajectories; served as ``GET /oracle``),
``random_action`` (the random baseline's next action; served as ``GET /random``),
``mistake_action`` (a mistake the expert could make now, the noise of ``omrl collect --noise``;
served as ``GET /mistake``; by default a random action),
``reset_fields`` (extra top-level fields of the ``/reset`` answer, where AgentGym's server
of the same env sends some) and ``close`` (free what the instance holds: a JVM, say).

The server runs ``reset``, ``step``, ``oracle_action`` and ``close`` one call at a time per
instance, by default in a worker thread, so an env may block (a JVM call, a planner, a
socket) without stalling other clients, and an env whose calls release the GIL (native
code, a JVM) serves several at once in one process. A pure-Python env whose calls take a few
milliseconds sets ``blocking = False``: its calls run on the server's event loop, without
the hand-off to a thread and back (BabyAI: x1.05 the requests/s), and ``omrl env-server
--workers N`` gives it more cores (envs/workers.py).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

from common.registry import Registry


class EpisodeError(RuntimeError):
    """An episode that cannot be finished: its group fails, counted under `reason` (an env's
    failures in envs/client.py, a reward function's in envs/rewards.py)."""

    reason = "episode_error"


@dataclasses.dataclass
class StepResult:
    """What one step answers. `info` holds extra top-level fields of the answer, named as
    AgentGym's server of the same env names them (`score`, ...); `success` in it, where an
    env sets it, says whether the episode counts as solved."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class Env:
    """One episode's state. Instances are never shared between clients."""

    blocking = True
    """Calls may block or release the GIL: the server runs them in worker threads. False: calls
    are pure Python and quick (milliseconds), and run on the server's event loop."""

    def __init__(self, **options: Any):
        if options:
            raise TypeError(f"{type(self).__name__} takes no options, got {sorted(options)}")

    def reset(self, task_idx: int) -> str:
        """Start task `task_idx`; return the first observation."""
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        raise NotImplementedError

    def observation(self) -> str:
        raise NotImplementedError

    def reset_fields(self) -> dict[str, Any]:
        """Extra top-level fields of the /reset answer (AgentGym's babyai sends `score`...)."""
        return {}

    def oracle_action(self) -> str:
        """The next action of an expert that sees the whole state."""
        raise NotImplementedError(f"{type(self).__name__} has no oracle")

    def random_action(self, rng: random.Random) -> str:
        """An action drawn uniformly from the actions that make sense now: the random baseline."""
        raise NotImplementedError(f"{type(self).__name__} has no random policy")

    def mistake_action(self, rng: random.Random) -> str:
        """A mistake the expert could make now: the noise `omrl collect --noise` mixes into the
        oracle's episodes, outside the loss, so that they show the recovery. By default a random
        action; an env whose models fail in a typical way makes that mistake instead."""
        return self.random_action(rng)

    def actions(self) -> list[str]:
        """The actions that make sense now, as the model would write them: with
        `actor.constrain_actions` the model's turn is decoded as one of them (a mask on its
        tokens). A superset of what the expert would do; never the answer alone."""
        raise NotImplementedError(f"{type(self).__name__} lists no admissible actions")

    def close(self) -> None:
        """Free what the instance holds; called once, when the client closes it or it is reaped."""


ENVS: Registry[Callable[..., Env]] = Registry("env", "env.name")
register_env = ENVS.register


def make_env(name: str, **options: Any) -> Env:
    import envs.builtin  # noqa: F401  (registers the built-in envs)

    return ENVS.lookup(name)(**options)
