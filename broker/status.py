"""Everything `omrl status` shows about a run, read from Redis with a handful of cheap
commands (counters and hashes; nothing scans a stream)."""

from __future__ import annotations

from typing import Any

from broker.admission import group_counts
from broker.connection import connect
from broker.evals import newest_eval
from broker.keys import Keys
from broker.membership import Membership
from broker.streams import stream_info
from broker.weights import WeightStore
from common.config import RedisConfig


async def status_of(cfg: RedisConfig) -> dict[str, Any]:
    """Connect to the run's Redis (redis.url), read its status, disconnect."""
    client = connect(cfg)
    try:
        return await run_status(client, Keys(cfg.run, cfg.shards), cfg.dead_after_s)
    finally:
        await client.aclose()


async def run_status(client, keys: Keys, dead_after_s: float) -> dict[str, Any]:
    streams = [await stream_info(client, keys, shard) for shard in range(keys.shards)]
    state = {k.decode(): v.decode() for k, v in (await client.hgetall(keys.learner_state)).items()}
    learner = ({"step": int(state["step"]), "version": int(state["version"]),
                "groups_trained": int(state.get("groups_trained", 0)),
                "groups_committed": int(state.get("groups_committed", 0))} if state else None)
    return {
        "run": keys.run,
        "streams": streams,
        "groups": accounting(await group_counts(client, keys), learner, streams),
        "members": await Membership(client, keys).members(dead_after_s),
        "learner": learner,
        "weights": await WeightStore(client, keys).latest(),
        "evaluation": await newest_eval(client, keys),
    }


def accounting(counts: dict[str, Any], learner: dict[str, Any] | None, streams: list[dict[str, Any]]) -> dict[str, Any]:
    """Every group started is produced, failed with a reason, or still running; every group
    produced is trained (and acknowledged), dead-lettered, filtered untrained (learner.filter_groups),
    or waiting in a stream (groups trained since the last checkpoint are still there).
    `unaccounted` is what the second sum misses: 0 unless Redis lost data, or copies a retried
    XADD wrote are waiting (or, while the learner runs, for the moment between an
    acknowledgement and its count)."""
    trained = learner["groups_committed"] if learner else 0
    waiting = sum(s["length"] for s in streams)
    dead, filtered = sum(counts["dead_lettered"].values()), sum(counts["filtered"].values())
    return {**counts, "trained": trained, "waiting": waiting,
            "unaccounted": counts["produced"] - trained - dead - filtered - waiting}


def format_accounting(groups: dict[str, Any]) -> str:
    def reasons(by_reason: dict[str, int]) -> str:
        return f" ({', '.join(f'{k} {v}' for k, v in by_reason.items())})" if by_reason else ""

    failed, dead = groups["failed"], groups["dead_lettered"]
    text = (f"groups: {groups['started']} started = {groups['produced']} produced + {sum(failed.values())} failed"
            f"{reasons(failed)} + {groups['held']} running; produced = {groups['trained']} trained + "
            f"{sum(dead.values())} dead-lettered{reasons(dead)} + "
            + (f"{sum(groups['filtered'].values())} filtered{reasons(groups['filtered'])} + " if groups["filtered"]
               else "")
            + f"{groups['waiting']} waiting in the streams")
    if groups["unaccounted"]:
        text += f" ({groups['unaccounted']:+d} unaccounted: copies waiting, or Redis lost data)"
    return text


def format_status(status: dict[str, Any]) -> str:
    lines = [f"run {status['run']}"]
    learner = status["learner"]
    lines.append(f"learner: step {learner['step']}, version {learner['version']}" if learner
                 else "learner: not started")
    lines.append(format_accounting(status["groups"]))
    for s in status["streams"]:
        lines.append(f"stream {s['stream']}: length {s['length']}, pending {s['pending']}, lag {s['lag']}, "
                     f"consumers {s['consumers']}")
    dead = status["groups"]["dead_lettered"]
    lines.append("dead letters: " + (", ".join(f"{k} {v}" for k, v in dead.items()) if dead else "none"))
    members = [m for m in status["members"] if m.get("role", "actor") == "actor"]
    lines.append(f"actors: {sum(m['alive'] for m in members)} live, {sum(not m['alive'] for m in members)} dead")
    for m in members:
        alive = m.get("state", "live") if m["alive"] else "DEAD"  # "starting": its engine's start
        lines.append(f"  {m['id']:<32} {alive}  index {m.get('index')}  version {m.get('version')}  "
                     f"groups {m.get('groups')}  failed {m.get('groups_failed', 0)}  tokens/s {m.get('tokens_per_s')}  "
                     f"host {m.get('host')}")
    for m in (m for m in status["members"] if m.get("role") == "evaluator"):
        lines.append(f"evaluator {m['id']}: {'live' if m['alive'] else 'DEAD'}, version {m.get('version')}, "
                     f"{m.get('evaluations')} evaluations")
    e = status.get("evaluation")
    lines.append(f"evaluation: version {e['version']}, success {e['success']:.3f} [{e['success_ci'][0]:.3f}, "
                 f"{e['success_ci'][1]:.3f}], reward {e['reward']:.3f} [{e['reward_ci'][0]:.3f}, {e['reward_ci'][1]:.3f}], "
                 f"{e['episodes']} held-out episodes" if e else "evaluation: none yet")
    return "\n".join(lines)
