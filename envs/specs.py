"""What a client must know about each env to talk to its server, whoever started it: the
protocol family, the request field that names a task, which answer field is the reward
and how to read it, what counts as success, which task indices exist and which are held
out for evaluation, and how AgentGym's own client cleans an action before sending it.

One entry per env, named as AgentGym names its servers; an env not listed (a new one of
ours, or someone's own server) gets the defaults of the "id" family with `data_idx`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from common.config import EnvConfig

Protocol = Literal["id", "env_idx"]
Success = Literal["field", "done", "full_reward"]


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    name: str
    protocol: Protocol = "id"
    task_field: str = "data_idx"
    """The /reset field that names the task (babyai `data_idx`, alfworld `game`, webshop `session_id`)."""
    reset_extra: tuple[tuple[str, Any], ...] = ()
    """Fixed extra /reset fields (alfworld `world_type`)."""
    create_body: dict[str, Any] | None = None
    """JSON body of /create, for servers that want one (textcraft takes {})."""
    reward_field: str = "reward"
    """The answer field AgentGym's client uses as the reward (babyai and sciworld: `score`)."""
    reward_scale: float = 1.0
    """Multiplies the field (sciworld's score runs 0-100)."""
    reward_is_total: bool = False
    """The field is the episode's running total, not this step's increment."""
    success: Success = "field"
    """field: the answer's `success` (our envs), else full_reward; done: the episode ended done;
    full_reward: the rewards sum to 1 (after scaling)."""
    num_tasks: int | None = None
    """Task indices are 0..num_tasks-1 (None: env.num_tasks from the config)."""
    test_from: int | None = None
    """Indices from this one on are held out for evaluation (None: the last tenth)."""
    reset_prefix: str | None = None
    """A /reset answer field AgentGym's client puts before the first observation, with a newline
    (sciworld: `task_description`)."""
    clean_action: bool = False
    """AgentGym's client keeps only letters, digits, commas and spaces of the action (babyai, textcraft)."""
    refused: str | None = None
    """A regular expression an observation matches from its start when the env refused the action
    before it (textcraft: `Could not `); None: the env's refusals are not told apart."""

    def reset_body(self, task_idx: int) -> dict[str, Any]:
        return {self.task_field: task_idx, **dict(self.reset_extra)}

    def split(self, num_tasks: int | None = None) -> tuple[range, range]:
        """(train, test) task indices; test indices are never trained on."""
        n = self.num_tasks or num_tasks
        if n is None or n < 2:
            raise ValueError(f"env {self.name!r}: the number of tasks is unknown: set env.num_tasks (at least 2)")
        lo = self.test_from if self.test_from is not None else n - max(1, n // 10)
        if not 0 < lo < n:
            raise ValueError(f"env {self.name!r}: held-out tasks from {lo} leave no train or no test tasks of {n}")
        return range(0, lo), range(lo, n)

    def succeeded(self, done: bool, total_reward: float, info: dict[str, Any]) -> bool:
        """Whether an episode that ended so (`total_reward` scaled, `info` the last answer's
        fields) solved its task."""
        if self.success == "field" and "success" in info:
            return bool(info["success"])
        if self.success == "done":
            return done
        return total_reward >= 1.0 - 1e-6

    def refuses(self, observation: str) -> bool:
        """Whether `observation` says the env refused the action before it."""
        return self.refused is not None and re.match(self.refused, observation) is not None

    def tidy(self, action: str) -> str:
        """The action as AgentGym's client of this env sends it."""
        if not self.clean_action:
            return action
        return " ".join(re.sub(r"[^A-Za-z0-9, ]+", "", action).split())


SPECS: dict[str, EnvSpec] = {s.name: s for s in [
    # AgentGym "id" family.
    EnvSpec("babyai", reward_field="score", reward_is_total=True, success="done", num_tasks=40_000,
            test_from=36_000, clean_action=True),  # i -> level i % 40 + 1, seed i // 40: seeds 900+ held out
    EnvSpec("textcraft", create_body={}, success="full_reward", num_tasks=544, test_from=500,
            clean_action=True, refused="Could not "),
    EnvSpec("sciworld", reward_field="score", reward_scale=0.01, reward_is_total=True, success="full_reward",
            num_tasks=4639, test_from=4175, reset_prefix="task_description"),
    EnvSpec("alfworld", task_field="game", reset_extra=(("world_type", "Text"),), success="full_reward",
            num_tasks=2620, test_from=2420),
    EnvSpec("maze", task_field="game"),
    EnvSpec("wordle", task_field="seed"),
    # AgentGym "env_idx" family.
    EnvSpec("webshop", protocol="env_idx", task_field="session_id", success="full_reward"),
    EnvSpec("sqlgym", protocol="env_idx", task_field="item_id", success="full_reward", num_tasks=10_962,
            test_from=9428),
    *[EnvSpec(name, protocol="env_idx", task_field="id") for name in
      ("searchqa", "weather", "movie", "academia", "todo", "sheet")],
    EnvSpec("webarena", protocol="env_idx", task_field="idx", reset_extra=(("seed", 0),)),
]}


def spec_for(name: str, protocol: Protocol | None = None) -> EnvSpec:
    """The spec of env `name`; `protocol` (env.protocol) overrides the family."""
    spec = SPECS.get(name, EnvSpec(name))
    return dataclasses.replace(spec, protocol=protocol) if protocol and protocol != spec.protocol else spec


def spec_of(cfg: EnvConfig, name: str | None = None) -> EnvSpec:
    """The spec the config gives env `name` (default: env.name): the known one, its family set by
    env.protocol, and for env.name itself the fields env.spec sets."""
    name = name or cfg.name
    spec = spec_for(name, cfg.protocol)
    if name != cfg.name:
        return spec
    fields = cfg.spec.model_dump(exclude_none=True)
    if "reset_extra" in fields:
        fields["reset_extra"] = tuple(fields["reset_extra"].items())
    return dataclasses.replace(spec, **fields)
