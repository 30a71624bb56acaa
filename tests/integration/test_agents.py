"""Your own agent as the rollout (issue 29): the real actor loop serves its OpenAI-compatible
endpoint and runs the agent of examples/own-agent as each episode, in the actor's process
(actor.agent) and as a real HTTP service (actor.agent_url, examples/own-agent/service.py),
against a real env server and a real Redis; a scripted engine stands in for vLLM, so the
tokens sampled are known. Also: an agent's rewards posted to its session, its segments, and
every way an agent fails a group, counted by reason (never a reward of 0)."""

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from actors.engine import Generation
from actors.evaluator import Evaluator
from actors.worker import Actor
from broker.admission import group_counts, wake_waiting
from broker.connection import connect
from broker.embedded import free_port
from broker.evals import read_evals
from broker.keys import Keys
from broker.streams import RolloutConsumer
from broker.weights import WeightStore
from common.config import load_config
from common.messages import decode_group
from common.metrics import read_jsonl
from common.retry import wait_http
from envs.builtin import LettersEnv
from envs.server import EnvServer, serve
from envs.tasks import task_split

pytestmark = pytest.mark.redis
pytest.importorskip("openai")
ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "examples/own-agent"


class LetterEngine:
    """Says the prompt's last character and a line break, log-prob -0.5 a token; keeps each
    completion it sampled. The request's stop strings end the tokens (the agent sends "\\n")."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sampled, self.temperatures, self.stops = tokenizer, [], set(), set()

    async def generate(self, prompt_ids, max_tokens, temperature=None, turn_start=None, sent=None,
                       stops=None, choices=None) -> Generation:
        self.temperatures.add(temperature)
        self.stops.add(None if stops is None else tuple(stops))  # the agent's requests bring theirs
        await asyncio.sleep(3600 if self.tokenizer.decode(prompt_ids[-1:]) == "z" else 0.002)  # "z": a hung engine
        ids = (prompt_ids[-1:] + self.tokenizer.encode("\n", add_special_tokens=False))[:max_tokens]
        self.sampled.append(ids)
        return Generation(ids, [-0.5] * len(ids), "stop")

    async def load_weights(self, path: str) -> None:
        pass

    def shutdown(self) -> None:
        pass


def letters_reward(task: int) -> float:
    """What saying each prompt's last character earns on `task` (as the engine does)."""
    env, total, done, observation = LettersEnv(), 0.0, False, None
    observation = env.reset(task)
    while not done:
        result = env.step(observation[-1])
        total, done, observation = total + result.reward, result.done, result.observation
    return total


def run_actor(cfg, engine, groups: int, timeout: float = 60.0):
    """The actor until `groups` groups were pushed or failed, a stand-in learner acknowledging
    them and publishing a version a step; the decoded groups and the ticket counts."""
    keys = Keys(cfg.redis.run)

    async def scenario():
        runner = await serve(EnvServer(cfg.env.name), "127.0.0.1", cfg.env.port)
        actor = Actor(cfg, engine=engine)
        actor_task = asyncio.create_task(actor.run())
        client = connect(cfg.redis.url)
        store = WeightStore(client, keys, keep=1)
        consumer = RolloutConsumer(client, keys, "learner-0")
        await consumer.ensure_group()
        await store.publish(0, 0, b"weights-0")
        pushed, step = [], 0

        async def learn():
            nonlocal step
            while len(pushed) + sum(actor.failed.values()) < groups:
                assert not actor_task.done(), actor_task
                entries = await consumer.read(cfg.learner.groups_per_step, block_ms=200)
                pushed.extend(decode_group(e.data) for e in entries)
                await consumer.ack([e.id for e in entries])
                if entries:
                    step += 1
                    await store.publish(step, step, b"weights-%d" % step)
                    await wake_waiting(client, keys, cfg.learner.groups_per_step, cfg.learner.steps_ahead)

        try:
            await asyncio.wait_for(learn(), timeout)
        finally:
            actor.stop.set()
            await asyncio.wait_for(actor_task, 30)
            await runner.cleanup()
        entries = await consumer.read(100, block_ms=100)  # those pushed while it stopped
        pushed.extend(decode_group(e.data) for e in entries)
        counts = await group_counts(client, keys)
        await client.aclose()
        return actor, pushed, counts

    return asyncio.run(scenario())


def config(redis_url, run_name, tiny_model, tmp_path, *more):
    return load_config(None, [f'redis.url="{redis_url}"', f"redis.run={run_name}", f'model.path="{tiny_model}"',
                              f'run.run_dir="{tmp_path}"', f"env.port={free_port()}", "env.name=letters",
                              "actor.group_size=3", "actor.concurrent_groups=2", "actor.metrics_s=0.2",
                              "actor.heartbeat_s=0.2", "actor.weight_poll_s=0.05", "learner.groups_per_step=2",
                              "learner.eta=1", "redis.max_stream_len=64", *more], environ={})


def check_groups(groups, engine, cfg):
    """Every group: G episodes, one segment each (the tiny template extends), the env's reward
    for what was said, and exactly the engine's tokens, log-probs and versions."""
    sampled = {tuple(ids) for ids in engine.sampled}
    for group in groups:
        assert group.sampling["agent"] and sorted(group.episodes()) == list(range(cfg.actor.group_size))
        for sample in group.samples:
            assert sample.reward == pytest.approx(letters_reward(int(group.task_id)))
            assert sample.num_turns == 2 and sum(sample.turn_rewards) == pytest.approx(sample.reward)
            generated = [i for i, m in enumerate(sample.loss_mask) if m]
            turns = [tuple(sample.tokens[a:b + 1]) for a, b in _runs(generated)]
            assert len(turns) == 2 and set(turns) <= sampled
            assert all(sample.logprobs[i] == -0.5 for i in generated) and min(sample.versions[generated]) >= 0


def _runs(indices):
    out = []
    for i in indices:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def test_the_example_agent_plays_the_episodes_in_process_and_as_a_service(redis_server_url, run_name, tiny_model,
                                                                          tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cfg = config(redis_server_url, run_name, tiny_model, tmp_path, f'actor.agent="{AGENT}/agent.py:rollout_tiny"')
    engine = LetterEngine(tokenizer)
    actor, groups, counts = run_actor(cfg, engine, groups=6)
    assert len(groups) >= 6 and not actor.failed
    check_groups(groups, engine, cfg)
    assert counts["held"] == 0 and counts["started"] == counts["produced"] + sum(counts["failed"].values())
    (path,) = (tmp_path / "actors").glob("*.jsonl")
    # Every episode's second call extended its session: no splits. The actor's metrics count them.
    assert actor.rollouts.counts == {"calls": 2 * 3 * len(groups), "extended": 3 * len(groups), "splits": 0}
    last = read_jsonl(path)[-1]  # written after the drain: the final counts
    assert {k: last[f"actor/agent_{k}"] for k in actor.rollouts.counts} == actor.rollouts.counts
    assert last["actor/groups"] == actor.groups

    port = free_port()  # the same agent as a service, in a process of its own
    service = subprocess.Popen([sys.executable, str(AGENT / "service.py"), "--port", str(port), "--tiny"])
    try:
        wait_http(f"http://127.0.0.1:{port}/", 30, service.poll)
        cfg = config(redis_server_url, run_name + "-svc", tiny_model, tmp_path / "svc",
                     f'actor.agent_url="http://127.0.0.1:{port}/rollout"')
        engine = LetterEngine(tokenizer)
        actor, groups, counts = run_actor(cfg, engine, groups=4)
    finally:
        service.terminate()
        service.wait(10)
    assert len(groups) >= 4 and not actor.failed
    check_groups(groups, engine, cfg)


FAILING_AGENT = '''
import aiohttp


async def rollout(task, client):
    """By task index mod 5: raise, report no reward, hang in a call the engine never answers, make
    no call, or post a reward after each of two calls, the second of which drops the first
    exchange (a new segment)."""
    kind = task["task_id"] % 5
    if kind == 0:
        raise ValueError("the tool is broken")
    if kind == 2:  # the timeout cancels the call in flight, its generation with it: nothing waits for it
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say z"}])
    if kind == 3:
        return 1.0
    first = [{"role": "user", "content": "Say a"}]
    reply = await client.chat.completions.create(model="m", messages=first, stop=["\\n"], max_tokens=4)
    if kind == 1:
        return None
    async with aiohttp.ClientSession() as http:
        reward_url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/reward"
        await http.post(reward_url, json={"reward": 0.25})
        again = [{"role": "user", "content": "Say b"}]  # the first exchange dropped
        await client.chat.completions.create(model="m", messages=again, stop=["\\n"], max_tokens=4)
        await http.post(reward_url, json={"reward": 0.5})
    return {"reward": None, "success": True}
'''


def test_an_agent_that_fails_fails_its_group_with_the_reason_and_posted_rewards_follow_its_calls(
        redis_server_url, run_name, tiny_model, tmp_path):
    agent = tmp_path / "failing_agent.py"
    agent.write_text(FAILING_AGENT)
    cfg = config(redis_server_url, run_name, tiny_model, tmp_path, f'actor.agent="{agent}:rollout"',
                 "actor.agent_timeout_s=1", "env.num_tasks=40")
    engine = LetterEngine(AutoTokenizer.from_pretrained(tiny_model))
    actor, groups, counts = run_actor(cfg, engine, groups=30)
    assert set(actor.failed) == {"agent_error", "agent_no_reward", "agent_timeout", "agent_no_calls"}, actor.failed
    assert counts["held"] == 0 and counts["started"] == counts["produced"] + sum(counts["failed"].values())
    assert groups and all(int(g.task_id) % 5 == 4 for g in groups)
    for group in groups:  # two segments an episode, each with the episode's reward; the posted ones on their calls
        assert len(group.samples) == 2 * cfg.actor.group_size
        assert group.episodes() == [e for e in range(cfg.actor.group_size) for _ in range(2)]
        assert all(s.reward == 0.75 and s.success and s.num_turns == 1 for s in group.samples)
        assert [float(s.turn_rewards[0]) for s in group.samples[:2]] == [0.25, 0.5]


def test_the_evaluator_plays_the_held_out_tasks_with_the_agent_greedily_on_the_version(redis_server_url, run_name,
                                                                                      tiny_model, tmp_path):
    cfg = config(redis_server_url, run_name, tiny_model, tmp_path, f'actor.agent="{AGENT}/agent.py:rollout_tiny"',
                 "learner.eval_every=2", "learner.eval_tasks=6")
    engine = LetterEngine(AutoTokenizer.from_pretrained(tiny_model))

    async def scenario():
        runner = await serve(EnvServer(cfg.env.name), "127.0.0.1", cfg.env.port)
        client = connect(cfg.redis.url)
        store = WeightStore(client, Keys(cfg.redis.run), keep=2)
        evaluator = Evaluator(cfg, engine=engine)
        loop = asyncio.create_task(evaluator.run())
        records = []
        for version in range(4):
            await store.publish(version, version, b"v%d" % version)
            for _ in range(100):
                records, _ = await read_evals(client, Keys(cfg.redis.run), "0")
                if len(records) > version // 2:
                    break
                await asyncio.sleep(0.1)
        evaluator.stop.set()
        await asyncio.wait_for(loop, 30)
        await runner.cleanup()
        await client.aclose()
        return evaluator, records

    evaluator, records = asyncio.run(scenario())
    _train, test = task_split(cfg.env)
    held_out = list(test)[:6]
    assert [r["version"] for r in records] == [0, 2] and evaluator.rollouts is not None
    for record in records:  # every held-out task played by the agent through the endpoint, greedily
        assert record["episodes"] == 6
        assert record["reward"] == pytest.approx(sum(letters_reward(t) for t in held_out) / 6)
    assert engine.temperatures == {0.0} and evaluator.rollouts.counts["calls"] == 2 * 6 * 2


def test_omrl_eval_plays_the_held_out_tasks_with_the_agent(monkeypatch, tiny_model, tmp_path):
    """`omrl eval --policy model` with actor.agent: the agent plays every held-out task through
    an endpoint of the engine's, greedily (not the episode loop, whose requests bring no stop
    strings of their own); a name that does not load is one line naming the field."""
    import argparse

    import deploy.evaluate

    engine = LetterEngine(AutoTokenizer.from_pretrained(tiny_model))
    monkeypatch.setattr(deploy.evaluate, "model_engine", lambda cfg: engine)
    args = argparse.Namespace(env=["letters"], tasks=None, episodes=6, env_url=None, policy="model", temperature=0.0)
    cfg = load_config(None, [f'model.path="{tiny_model}"', "env.name=letters",
                             f'actor.agent="{AGENT}/agent.py:rollout_tiny"'], environ={})
    [result] = asyncio.run(deploy.evaluate._evaluate_all(cfg, args))
    _train, test = task_split(cfg.env)
    held_out = list(test)[:6]
    assert result.episodes == 6 and result.reward == pytest.approx(sum(letters_reward(t) for t in held_out) / 6)
    assert engine.temperatures == {0.0} and engine.stops == {("\n",)} and len(engine.sampled) == 2 * 6
    bad = cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"agent": f"{AGENT}/agent.py:nowhere"})})
    with pytest.raises(SystemExit, match="actor.agent = .*cannot be loaded"):
        asyncio.run(deploy.evaluate._evaluate_all(bad, args))
