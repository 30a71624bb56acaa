"""`babyai`: the 40 BabyAI levels behind AgentGym's text interface, answer for answer.

Task `data_idx` i is level `i % 40 + 1` of AgentGym's level table with seed `i // 40`. The
agent reads a description of what it sees (objects with their distances, the wall or box
it faces, what it carries) and a list of available actions: `turn left`, `turn right`,
`move forward`, and high-level ones that expand into several minigrid steps (`go to <obj>
<n>`, `pickup <obj> <n>`, `go through <door> <n>`, `toggle and go through <door> <n>`,
`toggle`, `drop`, `go to goal`, `check available actions`). The text of every observation,
the action list and its order, the paths behind high-level actions, the error messages, the
reward (minigrid's `1 - 0.9 * steps / max_steps`), `done` (only when that reward exceeds
0.5) and the running `score` follow AgentGym's server (agentenv-babyai), so a policy
trained here works against it unchanged; this is our own implementation of that
behaviour, checked against it on recorded episodes (tests/integration/test_env_babyai.py).

The oracle sees the whole grid: it plans the mission's sub-goals (go to, pick up, open,
put next to; in sequence) with a breadth-first search over minigrid's own moves, and
answers with the available action whose steps start the plan (the longest such), so it
uses the high-level actions where they agree with the plan.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import random
from typing import Any

from envs.base import Env, StepResult, register_env

log = logging.getLogger(__name__)

LEVELS = (
    "GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6", "GoToLocalS8N7", "GoToObjMazeS7",
    "GoToImpUnlock", "GoToSeqS5R2", "GoToRedBlueBall", "GoToDoor", "GoToObjDoor", "Open", "OpenRedDoor",
    "OpenDoorLoc", "OpenRedBlueDoorsDebug", "OpenDoorsOrderN4Debug", "Pickup", "UnblockPickup", "PickupLoc",
    "PickupDistDebug", "PickupAbove", "PutNextLocalS6N4", "PutNextS7N4Carrying", "Unlock", "UnlockLocalDist",
    "KeyInBox", "UnlockPickupDist", "BlockedUnlockPickup", "UnlockToUnlock", "ActionObjDoor", "FindObjS7",
    "KeyCorridorS6R3", "OneRoomS20", "MoveTwoAcrossS8N9", "SynthS5R2", "SynthLoc", "SynthSeq", "MiniBossLevel",
    "BossLevel", "BossLevelNoUnlock",
)
"""AgentGym's table: data_idx i plays BabyAI-{LEVELS[i % 40]}-v0 with seed i // 40."""

OBJECTS = {0: "unseen", 1: "empty", 2: "wall", 3: "floor", 4: "door", 5: "key", 6: "ball", 7: "box", 8: "goal",
           9: "lava", 10: "agent"}
COLORS = {0: "red", 1: "green", 2: "blue", 3: "purple", 4: "yellow", 5: "grey"}
DOOR_STATES = {0: "open", 1: "closed", 2: "locked"}
HEADINGS = ((1, 0), (0, 1), (-1, 0), (0, -1))  # minigrid's directions 0..3: right, down, left, up
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE = 0, 1, 2, 3, 4, 5
BLOCKING = ("wall", "box", "lava", "ball", "key")  # names a path may not cross
Cell = tuple[int, int]


def _minigrid():
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")  # minigrid imports pygame, which greets on stdout
    try:
        import gymnasium
        import minigrid  # noqa: F401  (registers the BabyAI levels)
    except ImportError as exc:
        raise ImportError(f"the babyai env needs minigrid and gymnasium: pip install openmanus-rl[babyai] ({exc})") from exc
    # The level generator prints each rejected sample to stdout, where a command's output goes
    # (`omrl collect` prints its file's path): the module's `print` becomes a debug log line.
    from minigrid.envs.babyai.core import roomgrid_level

    roomgrid_level.print = lambda *args, **kwargs: log.debug("minigrid: %s", " ".join(map(str, args)))
    return gymnasium


def _ahead(cell: Cell, heading: int) -> Cell:
    return (cell[0] + HEADINGS[heading][0], cell[1] + HEADINGS[heading][1])


def _dot(a: tuple[int, int], b: tuple[int, int]) -> int:
    return a[0] * b[0] + a[1] * b[1]


@dataclasses.dataclass
class _Seen:
    name: str  # "red ball", "blue closed door", "grey wall"
    cell: Cell
    distance: int  # Manhattan distance from the agent


@dataclasses.dataclass
class _View:
    """What the agent's view says: the description, and the actions (name -> minigrid
    steps) and error messages its text interface offers now."""

    description: str
    actions: dict[str, list[int]]
    errors: dict[str, str]


class _Describer:
    """The text interface of one observation (AgentGym's server's rules)."""

    def __init__(self, env, obs: dict[str, Any]):
        u = env.unwrapped
        self.pos: Cell = (int(u.agent_pos[0]), int(u.agent_pos[1]))
        self.heading = int(obs["direction"])
        self.carrying = u.carrying
        size = u.agent_view_size
        f = (int(u.dir_vec[0]), int(u.dir_vec[1]))
        r = (int(u.right_vec[0]), int(u.right_vec[1]))
        top_left = (self.pos[0] + f[0] * (size - 1) - r[0] * (size // 2),
                    self.pos[1] + f[1] * (size - 1) - r[1] * (size // 2))
        far = (top_left[0] + size * (r[0] - f[0]), top_left[1] + size * (r[1] - f[1]))
        # The view's extent as AgentGym bounds it (one side inclusive, the other not).
        self.xs = range(far[0], top_left[0] + 1) if far[0] < top_left[0] else range(top_left[0], far[0])
        self.ys = range(far[1], top_left[1] + 1) if far[1] < top_left[1] else range(top_left[1], far[1])
        self.seen: list[_Seen] = []
        self.barriers: list[tuple[str, Cell, int]] = []  # boxes and walls on the line of sight
        image = obs["image"]
        for j in range(size):
            for i in range(size):
                cell = (top_left[0] - f[0] * j + r[0] * i, top_left[1] - f[1] * j + r[1] * i)
                distance = abs(self.pos[0] - cell[0]) + abs(self.pos[1] - cell[1])
                if cell[0] < 0 or cell[1] < 0 or distance == 0:
                    continue
                kind = OBJECTS[int(image[i, j, 0])]
                color = COLORS[int(image[i, j, 1])]
                if kind in ("door", "key", "ball", "box", "goal", "lava", "wall"):
                    name = f"{color} {DOOR_STATES[int(image[i, j, 2])]} door" if kind == "door" else f"{color} {kind}"
                    self.seen.append(_Seen(name, cell, distance))
                if kind in ("box", "wall"):
                    rel = (cell[0] - self.pos[0], cell[1] - self.pos[1])
                    heading = HEADINGS[self.heading]
                    if heading[0] * rel[1] - heading[1] * rel[0] == 0:
                        self.barriers.append((kind, cell, _dot(heading, rel)))
        self.seen.sort(key=lambda s: s.distance)  # stable: ties keep the scan order
        self.barriers.sort(key=lambda b: b[2])

    # -- the description ---------------------------------------------------------------
    def description(self) -> str:
        if self.seen:
            text = "In front of you in this room, you can see several objects: "
            counts: collections.Counter[str] = collections.Counter()
            for s in self.seen:
                if "wall" in s.name:
                    continue
                counts[s.name] += 1
                text += f"There is a {s.name} {counts[s.name]} {self._where(s.cell)} "
        else:
            text = "You cannot see any objects within sight."
        text += "The room has walls around you. "
        if self.barriers:
            kind, _cell, distance = self.barriers[0]
            text += f"You are facing a {kind} {distance} steps away. "
        if self.carrying is not None:
            return text + f"You are carrying a {self.carrying.color} {self.carrying.type}."
        return text + "You are not carrying anything."

    def _where(self, cell: Cell) -> str:
        rel = (cell[0] - self.pos[0], cell[1] - self.pos[1])
        front = _dot(HEADINGS[self.heading], rel)
        right = _dot(HEADINGS[(self.heading + 1) % 4], rel)
        if right == 0:
            return f"right in front of you {front} steps away. "
        side = "right" if right > 0 else "left"
        return f"{front} steps in front of you and {abs(right)} steps to your {side}. "

    # -- the actions -------------------------------------------------------------------
    def view(self) -> _View:
        actions: dict[str, list[int]] = {"turn left": [LEFT], "turn right": [RIGHT]}
        errors: dict[str, str] = {}
        if not self.barriers or self.barriers[0][2] > 1:
            actions["move forward"] = [FORWARD]
        else:
            errors["move forward"] = "There is a barrier in front of you, you can't move forward."
        if self.carrying is None:
            self._numbered(actions, errors, "pickup", [s for s in self.seen if not any(
                k in s.name for k in ("wall", "door", "goal"))], arrive=False, then=[PICKUP])
        self._drop(actions, errors)
        self._doors(actions, errors)
        for s in self.seen:
            if "goal" in s.name:
                path = self.path(s.cell, arrive=True)
                if path is not None:
                    actions["go to goal"] = path
                else:
                    errors["go to goal"] = "You cannot go to the goal, as there is no path leading to it."
        self._numbered(actions, errors, "go to", [s for s in self.seen if "wall" not in s.name and "goal" not in s.name],
                       arrive=False, then=[])
        actions["check available actions"] = []
        return _View(self.description(), actions, errors)

    def _numbered(self, actions, errors, verb: str, targets: list[_Seen], arrive: bool, then: list[int]) -> None:
        """`<verb> <name> <n>`: the n-th reachable object of that name, nearest first."""
        counts: dict[str, int] = {}
        error_verb = "pickup" if verb == "pickup" else "go to"
        for s in targets:
            path = self.path(s.cell, arrive=arrive)
            first = f"{verb} {s.name} 1"
            if path is not None:
                counts[s.name] = 1 if first not in actions else counts[s.name] + 1
                actions[f"{verb} {s.name} {counts[s.name]}"] = path + then
            else:
                n = 1 if first not in actions else counts[s.name] + 1
                errors[f"{verb} {s.name} {n}"] = (f"You cannot {error_verb} {s.name} {n}, as there is no path "
                                                  f"leading to it.")

    def _drop(self, actions, errors) -> None:
        if self.carrying is None:
            errors["drop"] = "You cannot drop the object, as you are not carrying anything."
            return
        front = _ahead(self.pos, self.heading)
        if any(s.cell == front and any(k in s.name for k in BLOCKING) for s in self.seen):
            errors["drop"] = "You cannot drop the object, as there is already an object in front of you."
        else:
            actions["drop"] = [DROP]

    def _doors(self, actions, errors) -> None:
        counts: dict[str, int] = {}
        for s in self.seen:
            if "door" not in s.name:
                continue
            counts[s.name] = counts.get(s.name, 0) + 1
            label = f"{s.name} {counts[s.name]}"
            if "open door" in s.name:
                path = self.path(s.cell, arrive=True)
                if path is not None:
                    actions[f"go through {label}"] = path
                else:
                    errors[f"go through {label}"] = f"You cannot go through {label}, as there is no path leading to it."
            if "closed door" in s.name:
                self._toggle_through(actions, errors, s, label, counts)
                errors[f"go through {label}"] = (f"You cannot go through {label}, as it is closed. "
                                                 f"You should toggle it first.")
            if "locked door" in s.name:
                key = self.carrying
                if key is None or key.type != "key":
                    errors[f"toggle and go through {label}"] = (f"You cannot toggle and go through {label}, as you "
                                                                f"are not carrying a key.")
                elif key.color != s.name.split(" ")[0]:
                    errors[f"toggle and go through {label}"] = (
                        f"You cannot toggle and go through {label}, as the color of the key you are carrying does "
                        f"not match the color of door.")
                else:
                    self._toggle_through(actions, errors, s, label, counts)

    def _toggle_through(self, actions, errors, door: _Seen, label: str, counts: dict[str, int]) -> None:
        path = self.path(door.cell, arrive=False)
        if path is not None:
            actions[f"toggle and go through {label}"] = path + [TOGGLE, FORWARD]
        else:  # AgentGym prints the whole count table here
            errors[f"toggle and go through {label}"] = (f"You cannot toggle and go through {door.name} {counts}, as "
                                                        f"there is no path leading to it.")
        if path == []:
            actions["toggle"] = [TOGGLE]

    def path(self, goal: Cell, arrive: bool) -> list[int] | None:
        """Minigrid steps from here to the goal cell (arrive) or to facing it from next door,
        inside the view, around what is seen to block. AgentGym's breadth-first search,
        whose parent links the last discovery overwrites: its paths, not just any shortest."""
        start = (self.pos, self.heading)
        blocked = {s.cell for s in self.seen if any(k in s.name for k in BLOCKING)}
        blocked |= {cell for _kind, cell, _d in self.barriers}
        queue, popped, parent = collections.deque([start]), set(), {}
        while queue:
            state = queue.popleft()
            popped.add(state)
            cell, heading = state
            if (cell == goal) if arrive else (_ahead(cell, heading) == goal):
                steps = []
                while state != start:
                    state, step = parent[state]
                    steps.append(step)
                return steps[::-1]
            for step in (FORWARD, LEFT, RIGHT):
                nxt = ((_ahead(cell, heading), heading) if step == FORWARD else
                       (cell, (heading - 1) % 4 if step == LEFT else (heading + 1) % 4))
                if nxt[0][0] not in self.xs or nxt[0][1] not in self.ys or nxt in popped or nxt[0] in blocked:
                    continue
                queue.append(nxt)
                parent[nxt] = (state, step)
        return None


@register_env("babyai")
class BabyAIEnv(Env):
    blocking = False  # pure Python, quick: served on the event loop

    def __init__(self):
        self._gym = _minigrid()
        self.env = None
        self.view: _View | None = None
        self.goal = ""
        self.text = ""
        self.reward, self.score, self.done = 0.0, 0.0, False
        self.image = None

    def reset(self, task_idx: int) -> str:
        if task_idx < 0:
            raise RuntimeError(f"data_idx must be at least 0, got {task_idx}")
        if self.env is not None:
            self.env.close()
        self.env = self._gym.make(f"BabyAI-{LEVELS[task_idx % 40]}-v0", disable_env_checker=True)
        obs, _info = self.env.reset(seed=task_idx // 40)
        self.goal = self.env.unwrapped.mission.replace("then", "and").replace("after you", "and")
        self.view = _Describer(self.env, obs).view()
        self.text = self.view.description
        self.image = obs["image"]
        self.reward, self.score, self.done = 0.0, 0.0, False
        return f"Your goal: {self.goal}\n{self.text}{self._action_list()}"

    def reset_fields(self) -> dict[str, Any]:
        return {"reward": self.reward, "score": self.reward, "deleted": False, "done": self.done}

    def _action_list(self) -> str:
        return "\nAvailable actions: [" + ", ".join(f'"{a}"' for a in self.view.actions) + "]"

    def _reset_first(self) -> None:
        if self.view is None:
            raise RuntimeError("env {id} has no task yet: POST /reset first")

    def step(self, action: str) -> StepResult:
        self._reset_first()
        if self.done:
            raise RuntimeError("The task with environment {id} has finished.")
        action = action.lower().strip()
        if "check" in action:
            self.text = "You can take the following actions: " + ", ".join(self.view.actions)
        elif action not in self.view.actions:
            self.text = ("No change in state." if action == "" else
                         self.view.errors.get(action, "The action is not recognized. Please check valid actions."))
        elif not self.view.actions[action]:
            self.text = "No change in state."
        else:
            self._execute(self.view.actions[action])
        self.score += self.reward
        info = {"score": self.score, "success": self.done}
        return StepResult(self.text + self._action_list(), self.reward, self.done, info)

    def _execute(self, steps: list[int]) -> None:
        """Minigrid steps in turn, stopping at the first that changes nothing in view."""
        for step in steps:
            obs, reward, terminated, _truncated, _info = self.env.step(step)
            changed = (obs["image"] != self.image).any()
            if not changed:
                break
            self.image = obs["image"]
        self.image = obs["image"]
        self.view = _Describer(self.env, obs).view()
        self.text = self.view.description + ("\n The task is completed." if terminated else "")
        self.reward = float(reward)
        self.done = bool(terminated) and self.reward > 0.5
        if self.reward == 1 and not self.done:
            self.done = True
            self.text += "\n The task is completed."

    def observation(self) -> str:
        self._reset_first()
        return f"Your goal: {self.goal}\n{self.text}{self._action_list()}"

    def random_action(self, rng: random.Random) -> str:
        self._reset_first()
        return rng.choice(list(self.view.actions))

    def actions(self) -> list[str]:
        """The observation's list of available actions."""
        self._reset_first()
        return list(self.view.actions)

    def oracle_action(self) -> str:
        self._reset_first()
        plan = _Planner(self.env.unwrapped).plan()
        if not plan:
            return "check available actions"
        best, length = "", 0
        for name, steps in self.view.actions.items():
            if steps and steps == plan[:len(steps)] and len(steps) > length:
                best, length = name, len(steps)
        if best:
            return best
        log.debug("no available action starts the plan %s; turning", plan)
        return "turn left"

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


class _Planner:
    """Full-state planning for BabyAI missions: the mission's actions in order (sequences
    of go to / pick up / open / put next to), each a breadth-first search over minigrid's
    own moves with the whole grid known. What stands in the way is cleared first: a locked
    door is opened with its key (fetched from the floor or a box), an object blocking a
    passage is picked up and put down out of the way."""

    def __init__(self, u):
        self.u = u
        self.grid = u.grid
        self.pos: Cell = (int(u.agent_pos[0]), int(u.agent_pos[1]))
        self.heading = int(u.agent_dir)
        self.carrying = u.carrying
        self.avoid: set[Cell] = set()  # cells a path to the current target crosses: drop nothing there

    def plan(self) -> list[int]:
        for instr in self._pending(self.u.instrs):
            steps = self._plan_one(instr)
            if steps:
                return steps
        return []

    def _pending(self, instr) -> list:
        """The action instructions still to do, in an order the mission accepts (the
        sequence verifiers keep which parts succeeded)."""
        kind = type(instr).__name__
        if kind not in ("BeforeInstr", "AfterInstr", "AndInstr"):
            return [instr]
        a = [] if instr.a_done == "success" else self._pending(instr.instr_a)
        b = [] if instr.b_done == "success" else self._pending(instr.instr_b)
        return b + a if kind == "AfterInstr" else a + b

    def _plan_one(self, instr) -> list[int]:
        kind = type(instr).__name__
        if kind == "GoToInstr":
            return self._reach({tuple(p) for p in instr.desc.obj_poss})
        if kind == "PickupInstr":
            targets = [o for o in instr.desc.obj_set if o.cur_pos is not None]
            return self._pick_up({tuple(o.cur_pos) for o in targets})
        if kind == "OpenInstr":
            doors = [d for d in instr.desc.obj_set if not d.is_open]
            if any(self._has_key(d) for d in doors) or not any(d.is_locked for d in doors):
                return self._reach({tuple(d.cur_pos) for d in doors}, [TOGGLE])
            return self._fetch_key(next(d for d in doors if d.is_locked).color)
        if kind == "PutNextInstr":
            moving = [o for o in instr.desc_move.obj_set if o.cur_pos is not None or o is self.carrying]
            if self.carrying is None or self.carrying not in moving:
                return self._pick_up({tuple(o.cur_pos) for o in moving if o.cur_pos is not None})
            targets = {tuple(b.cur_pos) for b in instr.desc_fixed.obj_set if b.cur_pos is not None}
            spots = {(x + dx, y + dy) for x, y in targets for dx, dy in HEADINGS}
            return self._reach({c for c in spots if self._empty(c)}, [DROP])
        return []

    # -- sub-goals -------------------------------------------------------------------
    def _pick_up(self, targets: set[Cell], depth: int = 0) -> list[int]:
        if self.carrying is None:
            return self._reach(targets, [PICKUP], depth)
        return self._open_with_key() or self._drop_somewhere(targets)

    def _has_key(self, door) -> bool:
        key = self.carrying
        return key is not None and key.type == "key" and key.color == door.color

    def _open_with_key(self) -> list[int]:
        """Carrying a key whose locked door is still shut: go and open it."""
        doors = {pos for pos, obj in self._objects() if obj.type == "door" and obj.is_locked and self._has_key(obj)}
        steps = self._search(lambda cell: cell in doors, relaxed=False)[0] if doors else None
        return steps + [TOGGLE] if steps is not None else []

    def _fetch_key(self, color: str, depth: int = 0) -> list[int]:
        if self.carrying is not None:
            return self._drop_somewhere(set())
        keys = {pos for pos, obj in self._objects() if obj.type == "key" and obj.color == color}
        if keys:
            return self._reach(keys, [PICKUP], depth + 1)
        boxes = {pos for pos, obj in self._objects() if obj.type == "box" and obj.contains is not None
                 and obj.contains.type == "key" and obj.contains.color == color}
        return self._reach(boxes, [TOGGLE], depth + 1)  # opening a box leaves what it held

    def _drop_somewhere(self, targets: set[Cell]) -> list[int]:
        """Put down what is carried on a free cell off the way to the targets, not in front of a door."""
        _steps, crossed = self._search(lambda cell: cell in targets, relaxed=True)
        avoid = set(crossed or ()) | self.avoid
        doors = {pos for pos, obj in self._objects() if obj.type == "door"}
        near_door = {(x + dx, y + dy) for x, y in doors for dx, dy in HEADINGS}

        def free(cell: Cell) -> bool:
            return self._empty(cell) and cell not in avoid and cell not in near_door and cell != self.pos
        steps = self._search(free, relaxed=False)[0]
        return steps + [DROP] if steps is not None else []

    def _reach(self, targets: set[Cell], then: list[int] = (), depth: int = 0) -> list[int]:
        """Steps to face one of the targets, then `then`; if the way is shut, clear it first."""
        steps, _cells = self._search(lambda cell: cell in targets, relaxed=False)
        if steps is not None:
            return steps + list(then)
        _steps, crossed = self._search(lambda cell: cell in targets, relaxed=True)
        if crossed is None or depth > 3:
            return []
        self.avoid |= set(crossed)
        blocker = next((c for c in crossed if not self._passable(c, relaxed=False)[0]), None)
        if blocker is None:
            return []
        obj = self.grid.get(*blocker)
        if obj.type == "door":  # locked, and its key is not carried
            return self._fetch_key(obj.color, depth)
        return self._pick_up({blocker}, depth + 1)  # something standing in the way

    # -- the grid --------------------------------------------------------------------
    def _objects(self):
        for i, obj in enumerate(self.grid.grid):
            if obj is not None:
                yield (i % self.grid.width, i // self.grid.width), obj

    def _empty(self, cell: Cell) -> bool:
        return 0 <= cell[0] < self.grid.width and 0 <= cell[1] < self.grid.height and self.grid.get(*cell) is None

    def _passable(self, cell: Cell, relaxed: bool) -> tuple[bool, int]:
        """Whether the agent can stand in `cell` and the steps it takes first (a closed door:
        toggle; a locked one: only with its key). Relaxed: locked doors and movable objects
        count as passable (to find what stands in the way)."""
        if not (0 <= cell[0] < self.grid.width and 0 <= cell[1] < self.grid.height):
            return False, 0
        obj = self.grid.get(*cell)
        if obj is None or obj.type == "goal":
            return True, 0
        if obj.type == "door":
            if obj.is_open:
                return True, 0
            if obj.is_locked and not self._has_key(obj):
                return relaxed, 1
            return True, 1
        return relaxed and obj.type in ("ball", "box", "key"), 1

    def _search(self, goal, relaxed: bool) -> tuple[list[int] | None, list[Cell] | None]:
        """Breadth-first over (cell, heading) to a state facing a cell where `goal(cell)`;
        minigrid's moves: turn, move forward (toggling first what is closed ahead). The steps
        and the cells entered, or (None, None)."""
        start = (self.pos, self.heading)
        queue, parent = collections.deque([start]), {start: None}
        while queue:
            state = queue.popleft()
            cell, heading = state
            ahead = _ahead(cell, heading)
            if goal(ahead):
                steps, cells = [], []
                while parent[state] is not None:
                    state, move = parent[state]
                    steps.extend(reversed(move))
                    if move[-1] == FORWARD:
                        cells.append(_ahead(*state))
                return steps[::-1], cells[::-1]
            moves = [([LEFT], (cell, (heading - 1) % 4)), ([RIGHT], (cell, (heading + 1) % 4))]
            ok, extra = self._passable(ahead, relaxed)
            if ok:
                moves.append(([TOGGLE, FORWARD] if extra else [FORWARD], (ahead, heading)))
            for move, nxt in moves:
                if nxt not in parent:
                    parent[nxt] = (state, move)
                    queue.append(nxt)
        return None, None
