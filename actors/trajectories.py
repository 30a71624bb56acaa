"""Trajectory files: expert (or any) episodes for supervised fine-tuning, as parquet.

One row per episode: `env`, `task_idx`, `policy`, `conversations` (AgentGym's turns: `from`
system / human / gpt, `value`, `loss`), and for the tokenizer that wrote the file `tokens`
and `loss_mask` (1 on the agent's tokens) exactly as the episode loop built them, with
`reward`, `success`, `num_turns`, `finish_reason`. `omrl collect` writes them by running an
env's oracle (or random policy) through the actors' own episode loop and templates;
`omrl import-trajectories` turns AgentGym / OpenManus-RL conversation files (JSON or JSON
lines of records with `conversations`, or OpenAI-style `messages` of `role`/`content`) into
the same rows. `tokenize` rebuilds a row's tokens from its conversation for any tokenizer,
with the turn format the actors use, so that supervised and RL training see the same tokens
and masks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from actors.chat import TurnFormat
from actors.episode import EpisodeSetup, Policy, run_episode
from envs.base import EpisodeError

ROLES = {"system": "system", "human": "human", "user": "human", "gpt": "gpt", "assistant": "gpt"}
"""AgentGym / ShareGPT `from` and OpenAI `role` names, to ours."""


class TrajectoryError(ValueError):
    """A conversation that cannot be a trajectory; the message names the record and the fix."""


def _turns(conversation: Sequence[dict[str, Any]], where: str) -> list[tuple[str, str, bool]]:
    """(role, text, trained) of each turn; `trained` is False for agent turns marked `"loss": false`."""
    turns = []
    for i, turn in enumerate(conversation):
        who = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if who not in ROLES or not isinstance(text, str):
            raise TrajectoryError(f"{where}, turn {i}: expected `from` (or `role`) in {sorted(ROLES)} and a string "
                                  f"`value` (or `content`), got {json.dumps(turn)[:120]}")
        turns.append((ROLES[who], text, turn.get("loss") is not False))
    return turns


def tokenize(fmt: TurnFormat, conversation: Sequence[dict[str, Any]], where: str = "conversation"
             ) -> tuple[list[int], list[int]]:
    """(tokens, loss_mask) of a conversation, as the episode loop builds them: an optional system
    turn, then human and agent turns in alternation, starting with a human one."""
    turns = _turns(conversation, where)
    system = turns.pop(0)[1] if turns and turns[0][0] == "system" else ""
    if not turns or turns[0][0] != "human":
        raise TrajectoryError(f"{where}: the conversation must start with a human turn (after an optional system one)")
    tokens = fmt.first_prompt(system, turns[0][1])
    mask = [0] * len(tokens)
    agent: list[int] | None = None
    for i, (role, text, trained) in enumerate(turns[1:], start=1):
        expected = "gpt" if i % 2 else "human"
        if role != expected:
            raise TrajectoryError(f"{where}, turn {i}: expected a {expected} turn, got {role}: human and agent turns "
                                  f"must alternate")
        if role == "gpt":
            agent = fmt.agent_turn(text)
            tokens += agent
            mask += [int(trained)] * len(agent)
        else:
            context = fmt.next_turn(agent, text)
            tokens += context
            mask += [0] * len(context)
    return tokens, mask


async def collect(setup: EpisodeSetup, policy: Policy, policy_name: str, tasks: Sequence[int],
                  concurrency: int = 32, progress=None) -> list[dict[str, Any]]:
    """One episode per task through the actors' episode loop; the rows of a trajectory file.
    `progress(done)` is called after each episode. An env or reward failure raises (EpisodeError)."""
    limit = asyncio.Semaphore(concurrency)
    rows: list[dict[str, Any]] = []

    async def one(task_idx: int) -> None:
        async with limit:
            conversation: list[dict[str, str]] = []
            sample = await run_episode(setup, policy, task_idx, conversation)
        rows.append({
            "env": setup.env_name, "task_idx": task_idx, "policy": policy_name,
            "conversations": [{"loss": turn["from"] == "gpt", **turn} for turn in conversation],
            "tokens": sample.tokens.tolist(), "loss_mask": sample.loss_mask.tolist(),
            "reward": float(sample.reward), "success": bool(sample.success), "num_turns": sample.num_turns,
            "finish_reason": sample.finish_reason,
        })
        if progress is not None:
            progress(len(rows))

    try:
        async with asyncio.TaskGroup() as tg:
            for t in tasks:
                tg.create_task(one(t))
    except* EpisodeError as errors:
        raise errors.exceptions[0] from None
    rows.sort(key=lambda r: r["task_idx"])
    return rows


def write_episodes(path: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(rows)
    turn = pa.struct([("from", pa.string()), ("value", pa.string()), ("loss", pa.bool_())])
    schema = pa.schema([("env", pa.string()), ("task_idx", pa.int64()), ("policy", pa.string()),
                        ("conversations", pa.list_(turn)), ("tokens", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.uint8())), ("reward", pa.float32()), ("success", pa.bool_()),
                        ("num_turns", pa.int32()), ("finish_reason", pa.string())])
    table = pa.Table.from_pylist([{name: row.get(name) for name in schema.names} for row in rows], schema=schema)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return Path(path)


def read_episodes(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a trajectory file (parquet), or of a conversation file (.json / .jsonl)."""
    path = Path(path)
    if not path.is_file():
        raise TrajectoryError(f"trajectory file {path} does not exist: write one with `omrl collect` or "
                              f"`omrl import-trajectories`")
    if path.suffix in (".json", ".jsonl"):
        return load_conversations(path)
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except OSError as exc:
        raise TrajectoryError(f"{path} is not a parquet trajectory file ({exc})") from None
    if rows and "conversations" not in rows[0]:
        raise TrajectoryError(f"{path} has no `conversations` column: it is not a trajectory file")
    return rows


def load_conversations(path: str | Path) -> list[dict[str, Any]]:
    """Records of an AgentGym / OpenManus-RL conversation file (a JSON list, or JSON lines), as
    trajectory rows without tokens. `item_id` ("babyai_12") gives the env and task where present."""
    text = Path(path).read_text()
    try:
        records = ([json.loads(line) for line in text.splitlines() if line.strip()] if str(path).endswith(".jsonl")
                   else json.loads(text))
    except json.JSONDecodeError as exc:
        raise TrajectoryError(f"{path} is not JSON{' lines' if str(path).endswith('.jsonl') else ''}: {exc}") from None
    if isinstance(records, dict):
        records = [records]
    rows = []
    for n, record in enumerate(records):
        where = f"{path}, record {n}"
        conversation = record.get("conversations", record.get("messages")) if isinstance(record, dict) else None
        if not isinstance(conversation, list):
            raise TrajectoryError(f"{where}: no `conversations` (or `messages`) list of turns")
        turns = _turns(conversation, where)
        item = str(record.get("item_id", record.get("id", "")))
        env, _, idx = item.rpartition("_")
        rows.append({"env": env or None, "task_idx": int(idx) if idx.isdigit() and env else None,
                     "policy": "imported",
                     "conversations": [{"from": role, "value": text, "loss": trained if role == "gpt" else False}
                                       for role, text, trained in turns],
                     "num_turns": sum(role == "gpt" for role, _text, _trained in turns)})
    return rows


def with_tokens(fmt: TurnFormat, rows: Iterable[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """The rows with `tokens` and `loss_mask` for `fmt`'s tokenizer."""
    out = []
    for n, row in enumerate(rows):
        tokens, mask = tokenize(fmt, row["conversations"], f"{where}, record {n}")
        out.append({**row, "tokens": tokens, "loss_mask": mask})
    return out
