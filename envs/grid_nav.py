"""`grid_nav`: walk to a goal on a small grid whose walls are only reported when bumped into.

Each task (seeded by its index) places a start, a goal and `walls` wall cells on a
`size` x `size` grid (the goal always reachable). The agent never sees the grid: each
observation is where the goal lies from where it stands, as in `e2n1` (2 east, 1 north;
`w` and `s` for the other ways), prefixed by `#` when the last move hit a wall or the edge.
Actions are one letter: `n`, `e`, `s`, `w`. Reaching the goal at turn t earns
`1 - penalty * (t - shortest)` (at least 0.1), `shortest` being the shortest path's length;
not reaching it within `turns` moves earns 0. The observations are the only way to know
where the goal is and where the walls are.
"""

from __future__ import annotations

import collections
import random

from envs.base import Env, StepResult, register_env

MOVES = {"n": (0, 1), "e": (1, 0), "s": (0, -1), "w": (-1, 0)}
Cell = tuple[int, int]


@register_env("grid_nav")
class GridNavEnv(Env):
    blocking = False  # pure Python, quick: served on the event loop

    def __init__(self, size: int = 4, walls: int = 2, turns: int = 8, penalty: float = 0.1):
        if not 2 <= size <= 9:
            raise ValueError("grid_nav: size must be in 2..9")
        if not 0 <= walls <= size * size - 2:
            raise ValueError("grid_nav: walls must leave room for the start and the goal")
        self.size, self.n_walls, self.turns, self.penalty = size, walls, turns, penalty
        self.walls: set[Cell] = set()
        self.pos = self.goal = (0, 0)
        self.turn, self.shortest, self.done = 0, 0, True
        self.last = ""

    def reset(self, task_idx: int) -> str:
        rng = random.Random(task_idx)
        cells = [(x, y) for x in range(self.size) for y in range(self.size)]
        while True:
            start, goal, *walls = rng.sample(cells, 2 + self.n_walls)
            self.walls, self.goal = set(walls), goal
            distance = self._distances(goal).get(start)
            if distance is not None:
                break
        self.pos, self.shortest, self.turn, self.done = start, distance, 0, False
        self.last = self._describe()
        return self.last

    def _open(self, cell: Cell) -> bool:
        return 0 <= cell[0] < self.size and 0 <= cell[1] < self.size and cell not in self.walls

    def _distances(self, target: Cell) -> dict[Cell, int]:
        """Moves from every reachable cell to `target` (breadth-first from the target)."""
        dist, queue = {target: 0}, collections.deque([target])
        while queue:
            cell = queue.popleft()
            for dx, dy in MOVES.values():
                nxt = (cell[0] + dx, cell[1] + dy)
                if self._open(nxt) and nxt not in dist:
                    dist[nxt] = dist[cell] + 1
                    queue.append(nxt)
        return dist

    def _describe(self) -> str:
        dx, dy = self.goal[0] - self.pos[0], self.goal[1] - self.pos[1]
        return ("e" if dx >= 0 else "w") + str(abs(dx)) + ("n" if dy >= 0 else "s") + str(abs(dy))

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("step after the episode ended")
        self.turn += 1
        move = MOVES.get(action.strip().lower())
        bumped = move is None
        if move is not None:
            nxt = (self.pos[0] + move[0], self.pos[1] + move[1])
            bumped = not self._open(nxt)
            if not bumped:
                self.pos = nxt
        if self.pos == self.goal:
            self.done, self.last = True, "="
            reward = max(0.1, 1.0 - self.penalty * (self.turn - self.shortest))
            return StepResult(self.last, reward, True, {"success": True, "state": self._state()})
        self.done = self.turn >= self.turns
        self.last = ("#" if bumped else "") + self._describe()
        return StepResult(self.last, 0.0, self.done, {"success": False, "state": self._state()})

    def _state(self) -> str:
        """The agent's cell, GiGPO's anchor key (`info["state"]`): the task fixes goal and walls."""
        return f"{self.pos[0]},{self.pos[1]}"

    def observation(self) -> str:
        return self.last

    def oracle_action(self) -> str:
        dist = self._distances(self.goal)
        return min(MOVES, key=lambda m: dist.get((self.pos[0] + MOVES[m][0], self.pos[1] + MOVES[m][1]), 10 ** 6))

    def random_action(self, rng: random.Random) -> str:
        return rng.choice(list(MOVES))
