"""actor.task_sampling (actors/sampling.py): uniform draws every train task alike; spread draws a
pool whose every group had no reward spread at the floor's weight, and brings it back once one of
its groups spreads."""

import collections
import random

import pytest

from actors.sampling import TaskSampler, pools_of
from common.config import ActorConfig, Config


def test_uniform_draws_as_the_actor_always_did():
    tasks = list(range(10))
    a, b = random.Random(3), random.Random(3)
    sampler = TaskSampler(tasks, a)
    assert [sampler.draw() for _ in range(50)] == [b.choice(tasks) for _ in range(50)]


def test_spread_draws_flat_pools_at_the_floor_and_pools_tasks_by_their_column():
    # 20 tasks: goal g's variants are tasks g and g + 10 (a task file's `goal` column)
    tasks = list(range(20))
    data = {t: {"goal": t % 10} for t in tasks}
    sampler = TaskSampler(tasks, random.Random(0), "spread", pools_of(tasks, "goal", data), floor=0.1)
    for t in range(10):  # every goal played once: goals 0-7 all failed, 8 spread, 9 all solved
        sampler.record(t, [0.0] * 8 if t < 8 else [0.0, 1.0] * 4 if t == 8 else [1.0] * 8)
    assert sampler.flat_pools == 9 and [sampler.weight(g) for g in (0, 8, 9)] == [0.1, 1.0, 0.1]
    draws = collections.Counter(data[sampler.draw()]["goal"] for _ in range(20_000))
    # goal 8 weighs 1, the nine others 0.1 each: 1 / 1.9 of the draws
    assert draws[8] / 20_000 == pytest.approx(1 / 1.9, abs=0.02)
    assert {t for t in (sampler.draw() for _ in range(2000)) if data[t]["goal"] == 8} == {8, 18}  # both variants
    sampler.record(10, [0.0, 0.0, 1.0, 0.0])  # goal 0's other variant spread: goal 0 is back at 1
    assert sampler.weight(0) == 1.0 and sampler.flat_pools == 8


def test_a_pool_column_the_task_files_lack_and_a_pool_without_spread_are_refused():
    with pytest.raises(ValueError, match=r"actor.task_pool = 'goal': 2 train tasks have no such column.*task 1"):
        pools_of([0, 1, 2], "goal", {0: {"goal": 0}})
    with pytest.raises(ValueError, match="task_pool = 'goal' pools tasks for actor.task_sampling"):
        Config(actor=ActorConfig(task_pool="goal"))
    Config(actor=ActorConfig(task_sampling="spread", task_pool="goal"))
