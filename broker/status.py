"""Everything `omrl status` shows about a run, read from Redis."""

from __future__ import annotations

from collections import Counter
from typing import Any

from broker.keys import Keys
from broker.membership import Membership
from broker.streams import stream_info
from broker.weights import WeightStore


async def run_status(client, keys: Keys, dead_after_s: float, dead_letter_scan: int = 100_000) -> dict[str, Any]:
    streams = [await stream_info(client, keys, shard) for shard in range(keys.shards)]
    reasons: Counter[str] = Counter()
    for _entry_id, fields in await client.xrevrange(keys.dead_letters, count=dead_letter_scan):
        reasons[fields.get(b"reason", b"?").decode()] += 1
    state = {k.decode(): v.decode() for k, v in (await client.hgetall(keys.learner_state)).items()}
    started = await client.get(keys.tickets_started)
    return {
        "run": keys.run,
        "streams": streams,
        "dead_letters": dict(sorted(reasons.items())),
        "members": await Membership(client, keys).members(dead_after_s),
        "learner": {"step": int(state["step"]), "version": int(state["version"])} if state else None,
        "weights": await WeightStore(client, keys).latest(),
        "groups_started": int(started) if started else 0,
    }


def format_status(status: dict[str, Any]) -> str:
    lines = [f"run {status['run']}"]
    learner = status["learner"]
    lines.append(f"learner: step {learner['step']}, version {learner['version']}" if learner
                 else "learner: not started")
    lines.append(f"groups started (admission tickets): {status['groups_started']}")
    for s in status["streams"]:
        lines.append(f"stream {s['stream']}: length {s['length']}, pending {s['pending']}, lag {s['lag']}, "
                     f"consumers {s['consumers']}")
    dead = status["dead_letters"]
    lines.append("dead letters: " + (", ".join(f"{k} {v}" for k, v in dead.items()) if dead else "none"))
    members = status["members"]
    lines.append(f"actors: {sum(m['alive'] for m in members)} live, {sum(not m['alive'] for m in members)} dead")
    for m in members:
        lines.append(f"  {m['id']:<32} {'live' if m['alive'] else 'DEAD'}  version {m.get('version')}  "
                     f"groups {m.get('groups')}  tokens/s {m.get('tokens_per_s')}  host {m.get('host')}")
    return "\n".join(lines)
