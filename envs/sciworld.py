"""`sciworld`: ScienceWorld's science experiments, as AgentGym's SciWorld server serves them.

Each instance is a ScienceWorld simulator from the `scienceworld` wheel: its own JVM (about
1.4 s to start, about 176 MB), so `omrl env-server` runs these calls in worker threads.
Task `data_idx` i is entry i of AgentGym's flat list of (task, variation) pairs: the wheel's
tasks in order, each with all its variations, leaving out 5-1, 5-2, 9-x and 10-x (4,639
pairs). `/reset` loads the pair, then plays `look around`; its answer carries
`task_name`, `var_num` and `task_description` beside the observation (AgentGym's client
shows `task_description + "\\n" + observation` first). `/step` answers the simulator's
observation, `reward` (the change in score), `score` (0-100, negative on failure) and
`done`; a step after done is refused, as AgentGym's server refuses it.

The oracle plays ScienceWorld's gold action sequence for the variation (generated at load).
"""

from __future__ import annotations

import random
import threading
from typing import Any

from envs.base import Env, StepResult, register_env

EXCLUDED = {"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"}  # AgentGym's server leaves these out


def _scienceworld():
    try:
        import scienceworld
    except ImportError as exc:
        raise ImportError(f"the sciworld env needs the scienceworld wheel and a Java runtime: "
                          f"pip install openmanus-rl[sciworld] ({exc})") from exc
    return scienceworld


_games: list[tuple[str, int]] = []
_games_lock = threading.Lock()


def games(sim) -> list[tuple[str, int]]:
    """AgentGym's flat task list: (task name, variation) for every task it keeps; asked of
    the first simulator once a process."""
    with _games_lock:
        if not _games:
            _games.extend((name, v) for task_id, name in sim.tasks.items() if task_id not in EXCLUDED
                          for v in range(sim.get_max_variations(name)))
    return _games


@register_env("sciworld")
class SciWorldEnv(Env):
    def __init__(self):
        self.sim = _scienceworld().ScienceWorldEnv()
        self.games = games(self.sim)
        self.fields: dict[str, Any] = {}
        self.last = ""
        self.gold: list[str] = []
        self.turn = 0
        self.done = True

    def reset(self, task_idx: int) -> str:
        if not 0 <= task_idx < len(self.games):
            raise RuntimeError(f"data_idx {task_idx} is out of range: there are {len(self.games)} tasks")
        name, variation = self.games[task_idx]
        self.sim.load(name, variation, generateGoldPath=True)
        description = self.sim.get_task_description()
        self.gold = self.sim.get_gold_action_sequence()
        observation, reward, done, info = self.sim.step("look around")
        self.fields = {"task_name": name, "var_num": variation, "task_description": description,
                       "reward": reward, "score": info["score"], "deleted": False, "done": done}
        self.last, self.turn, self.done = observation, 0, done
        return observation

    def reset_fields(self) -> dict[str, Any]:
        return self.fields

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("The task with environment {id} has finished.")
        observation, reward, done, info = self.sim.step(action)
        self.last, self.done = observation, done
        self.turn += 1
        return StepResult(observation, reward, done, {"score": info["score"], "success": info["score"] >= 100})

    def observation(self) -> str:
        return self.last

    def oracle_action(self) -> str:
        """The next action of the gold sequence (from the start: it is exact only on its path)."""
        return self.gold[self.turn] if self.turn < len(self.gold) else "look around"

    def random_action(self, rng: random.Random) -> str:
        valid = self.sim.get_valid_action_object_combinations()
        return rng.choice(valid) if valid else "look around"

    def close(self) -> None:
        self.sim.close()
