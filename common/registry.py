"""Names to what a decorator registered under them: envs (envs/base.py), action templates
(actors/templates.py) and reward functions (envs/rewards.py). A module of a user's own
registers more; `run.plugins` names it so that every process imports it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Registry(dict[str, T]):
    def __init__(self, kind: str, field: str):
        super().__init__()
        self.kind, self.field = kind, field  # what is registered, and the config field that names one

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self[name] = obj
            return obj
        return deco

    def lookup(self, name: str) -> T:
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}: choose one of {sorted(self)} ({self.field}), or "
                             f"register one in a module named in run.plugins") from None
