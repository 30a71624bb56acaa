"""Which train task an actor plays next (actor.task_sampling).

`uniform` (the default) draws every train task alike. `spread` draws less often the tasks whose
groups teach a group-relative estimator nothing: a pool of tasks (actor.task_pool, a column of
the task files: TextCraft's demo writes `goal`, so a goal's variants are one pool; unset, each
task is its own) whose every group this actor played had all its episodes' rewards alike (all
solved, or all failed) weighs actor.spread_floor; a pool not played yet, or one that had a group
with a spread, weighs 1. A pool is drawn by its weight, then a task of it at random. The floor
keeps every pool in play: one that was flat by chance comes back and, if it spreads, weighs 1
again. Each actor keeps its own record, from its own groups, and starts over when it restarts.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence
from typing import Any


def pools_of(tasks: Sequence[int], pool: str | None, task_data: Mapping[int, Mapping[str, Any]]
             ) -> dict[int, Hashable]:
    """Each task's pool: its value in the task files' column `pool` (actor.task_pool), or itself."""
    if pool is None:
        return {t: t for t in tasks}
    missing = [t for t in tasks if pool not in task_data.get(t, {})]
    if missing:
        raise ValueError(f"actor.task_pool = {pool!r}: {len(missing)} train tasks have no such column in the task "
                         f"files (for example task {missing[0]}): add it, or unset actor.task_pool")
    return {t: task_data[t][pool] for t in tasks}


class TaskSampler:
    """`pool_of`: each task's pool (`pools_of`; None: each task its own)."""

    def __init__(self, tasks: Sequence[int], rng: random.Random, mode: str = "uniform",
                 pool_of: Mapping[int, Hashable] | None = None, floor: float = 0.1):
        self.tasks, self.rng, self.mode, self.floor = list(tasks), rng, mode, floor
        self.pool_of = dict(pool_of) if pool_of is not None else {t: t for t in self.tasks}
        self.members: dict[Hashable, list[int]] = {}
        for t in self.tasks:
            self.members.setdefault(self.pool_of[t], []).append(t)
        self.pools = list(self.members)
        self.played: dict[Hashable, tuple[int, int]] = {}  # pool -> (groups, groups with a spread)

    def draw(self) -> int:
        if self.mode == "uniform":
            return self.rng.choice(self.tasks)
        [pool] = self.rng.choices(self.pools, weights=[self.weight(p) for p in self.pools])
        return self.rng.choice(self.members[pool])

    def weight(self, pool: Hashable) -> float:
        groups, spread = self.played.get(pool, (0, 0))
        return self.floor if groups and not spread else 1.0

    def record(self, task: int, rewards: Sequence[float]) -> None:
        """A group of `task` was played: its episodes' rewards."""
        pool = self.pool_of[task]
        groups, spread = self.played.get(pool, (0, 0))
        self.played[pool] = (groups + 1, spread + (max(rewards) > min(rewards)))

    @property
    def flat_pools(self) -> int:
        """Pools played whose every group had no spread (weighing the floor)."""
        return sum(1 for groups, spread in self.played.values() if groups and not spread)
