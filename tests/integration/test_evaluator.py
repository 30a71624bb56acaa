"""Evaluators scaled out (compose's --scale evaluator=N) share the versions: each slot of
learner.eval_every versions is evaluated once, by whichever claimed it first. Two real
Evaluator loops (scripted engines in place of vLLM, so the test takes seconds), a real env
server and a real Redis server; versions published one by one as the learner publishes them.
A restarted evaluator (the same name) takes its predecessor's slot again, unless its evaluation
was published; no other evaluator takes it."""

import asyncio

import pytest
from transformers import AutoTokenizer

from actors.evaluator import Evaluator
from broker.connection import connect
from broker.embedded import free_port
from broker.evals import claim_eval, read_evals
from broker.keys import Keys
from broker.weights import WeightStore
from common.config import load_config
from envs.server import EnvServer, serve
from tests.integration.test_actor_faults import ScriptedEngine

pytestmark = pytest.mark.redis

EVERY, VERSIONS = 2, 12


def test_scaled_out_evaluators_share_the_versions_each_slot_once(redis_server_url, run_name, tiny_model):
    env_port = free_port()
    cfg = load_config(None, [f'redis.url="{redis_server_url}"', f"redis.run={run_name}", f'model.path="{tiny_model}"',
                             f"env.port={env_port}", "env.name=letters", f"learner.eval_every={EVERY}",
                             "learner.eval_tasks=4", "actor.max_turns=2", "actor.weight_poll_s=0.05",
                             "actor.heartbeat_s=0.2"], environ={})
    keys = Keys(run_name)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    async def scenario():
        runner = await serve(EnvServer(cfg.env.name), "127.0.0.1", env_port)
        client = connect(redis_server_url)
        store = WeightStore(client, keys, keep=2)
        evaluators = [Evaluator(cfg, engine=ScriptedEngine(tokenizer)) for _ in range(2)]
        for evaluator, name in zip(evaluators, ("host-a-evaluator", "host-b-evaluator")):
            evaluator.name = name  # one process here: two hosts' names
        loops = [asyncio.create_task(e.run()) for e in evaluators]
        for version in range(VERSIONS):
            await store.publish(version, version, b"v%d" % version)
            await asyncio.sleep(0.25)
        for _ in range(200):  # the last slot's evaluation
            records, _ = await read_evals(client, keys, "0")
            if any(r["version"] // EVERY == (VERSIONS - 1) // EVERY for r in records):
                break
            await asyncio.sleep(0.1)
        for evaluator in evaluators:
            evaluator.stop.set()
        await asyncio.wait_for(asyncio.gather(*loops), 30)
        records, _ = await read_evals(client, keys, "0")
        first_slot = min(r["version"] // EVERY for r in records)
        holder = (await client.hget(keys.eval_claims, str(first_slot))).decode()
        claims = {"published, its claimer's successor": await claim_eval(client, keys, first_slot,
                                                                           holder.removesuffix(":done")),
                  "unpublished, first": await claim_eval(client, keys, 99, "host-c-evaluator"),
                  "unpublished, its claimer's successor": await claim_eval(client, keys, 99, "host-c-evaluator"),
                  "unpublished, another": await claim_eval(client, keys, 99, "host-d-evaluator")}
        await client.aclose()
        await runner.cleanup()
        return evaluators, records, holder, claims

    evaluators, records, holder, claims = asyncio.run(scenario())
    slots = [r["version"] // EVERY for r in records]
    assert len(slots) == len(set(slots)), slots  # no slot evaluated twice
    assert (VERSIONS - 1) // EVERY in slots and len(slots) >= 2, slots
    assert len(records) == sum(e.evaluations for e in evaluators)
    assert all(r["episodes"] == 4 and r["version"] == r["last_version"] for r in records)
    assert holder in ("host-a-evaluator:done", "host-b-evaluator:done")
    assert claims == {"published, its claimer's successor": False, "unpublished, first": True,
                      "unpublished, its claimer's successor": True, "unpublished, another": False}


def test_the_claims_stay_one_hash_of_the_newest_slots(redis_server_url, run_name, monkeypatch):
    """A run of days claims a slot every eval_every versions: the claims are one hash that
    keeps the newest CLAIMS_KEPT slots (3 here), not a key a slot."""
    from broker import evals

    monkeypatch.setattr(evals, "CLAIMS_KEPT", 3)

    async def scenario() -> tuple[list[bytes], int, bool, bool]:
        client, keys = connect(redis_server_url), Keys(run_name)
        try:
            for slot in range(10):
                assert await claim_eval(client, keys, slot, "host-a-evaluator")
            kept = sorted(await client.hkeys(keys.eval_claims), key=int)
            stray = len([k async for k in client.scan_iter(f"{keys.prefix}:eval:*")])
            return kept, stray, await claim_eval(client, keys, 9, "host-b-evaluator"), \
                await claim_eval(client, keys, 9, "host-a-evaluator")
        finally:
            await client.aclose()

    kept, stray, other, same = asyncio.run(scenario())
    assert kept == [b"7", b"8", b"9"] and stray == 1  # the hash alone
    assert not other and same  # a kept claim still holds: another is refused, a restart takes it again
