"""What an environment is, and the registry that names the built-in ones.

Adding an env is a class with ``reset`` and ``step`` and one decorator::

    @register_env("my_env")
    class MyEnv(Env):
        def reset(self, task_idx: int) -> str: ...
        def step(self, action: str) -> StepResult: ...
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class Env:
    """One episode's state. Instances are never shared between clients."""

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


ENVS: dict[str, Callable[..., Env]] = {}


def register_env(name: str) -> Callable[[type[Env]], type[Env]]:
    def deco(cls: type[Env]) -> type[Env]:
        if name in ENVS:
            raise ValueError(f"env {name!r} is registered twice")
        ENVS[name] = cls
        return cls
    return deco


def make_env(name: str, **options: Any) -> Env:
    import envs.builtin  # noqa: F401  (registers the built-in envs)

    try:
        factory = ENVS[name]
    except KeyError:
        raise ValueError(f"unknown env {name!r}: choose one of {sorted(ENVS)} (env.name)") from None
    return factory(**options)
