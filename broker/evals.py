"""Evaluation results on held-out tasks: the evaluator (actors/evaluator.py) claims each slot of
learner.eval_every versions before it evaluates one of them and writes one JSON record per
evaluation to a capped stream; the learner reads those newer than what it has seen into
metrics.jsonl, and `omrl status` shows the newest."""

from __future__ import annotations

import json
from typing import Any

from broker.keys import Keys

KEEP = 1000
# Claims of slots this far below a newly claimed one are dropped: evaluators claim the slot of
# the newest version, and a learner resumed from its checkpoint goes back far less. One hash
# of at most this many fields, however long the run (a key a slot grew without end: the soak).
CLAIMS_KEPT = 1000

# KEYS[1] the claims hash; ARGV slot, evaluator, CLAIMS_KEPT. 1: the slot is the evaluator's.
_CLAIM_LUA = """
local slot = tonumber(ARGV[1])
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
    for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
        if tonumber(field) <= slot - tonumber(ARGV[3]) then redis.call('HDEL', KEYS[1], field) end
    end
    return 1
end
return redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] and 1 or 0
"""


async def claim_eval(client, keys: Keys, slot: int, evaluator: str) -> bool:
    """Whether `evaluator` takes evaluation slot `slot` (the versions from slot * eval_every on):
    the first to ask does, so evaluators scaled out (compose's --scale) share the versions
    instead of each evaluating every one. A restarted evaluator (the same name: one a host or
    container) takes its predecessor's slot again, whose evaluation died with it, unless that
    evaluation was published (`finish_eval`)."""
    taken = await client.eval(_CLAIM_LUA, 1, keys.eval_claims, slot, evaluator, CLAIMS_KEPT)
    return bool(taken)


async def finish_eval(client, keys: Keys, slot: int, evaluator: str, record: dict[str, Any]) -> None:
    """The evaluation of slot `slot` published, and its claim marked done in one transaction: no
    evaluator, not even a restart of this one, plays that slot again."""
    async with client.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.evals, {b"r": json.dumps(record)}, maxlen=KEEP, approximate=True)
        pipe.hset(keys.eval_claims, str(slot), f"{evaluator}:done")
        await pipe.execute()


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
