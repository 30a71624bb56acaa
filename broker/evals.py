"""Evaluation results on held-out tasks: the evaluator (actors/evaluator.py) writes one JSON record
per evaluation to a capped stream; the learner reads those newer than what it has seen into
metrics.jsonl, and `omrl status` shows the newest."""

from __future__ import annotations

import json
from typing import Any

from broker.keys import Keys

KEEP = 1000


async def publish_eval(client, keys: Keys, record: dict[str, Any]) -> None:
    await client.xadd(keys.evals, {b"r": json.dumps(record)}, maxlen=KEEP, approximate=True)


async def newest_eval(client, keys: Keys) -> dict[str, Any] | None:
    """The newest evaluation's record, or None."""
    newest = await client.xrevrange(keys.evals, count=1)
    return json.loads(newest[0][1][b"r"]) if newest else None


async def last_eval_id(client, keys: Keys) -> str:
    """The id of the newest record ("0" if none): a reader starting now skips the history."""
    newest = await client.xrevrange(keys.evals, count=1)
    return newest[0][0].decode() if newest else "0"


async def read_evals(client, keys: Keys, after: str) -> tuple[list[dict[str, Any]], str]:
    """Records newer than id `after`, and the id to read after next time."""
    entries = await client.xrange(keys.evals, min=f"({after}" if after != "0" else "-", max="+")
    if not entries:
        return [], after
    return [json.loads(fields[b"r"]) for _, fields in entries], entries[-1][0].decode()
