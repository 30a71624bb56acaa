"""A real vLLM engine on the tiny model: log-probs agree with the learner's model, weights
reload in place, and the episode loop keeps tokens exactly as sampled."""

import asyncio

import aiohttp
import numpy as np
import pytest
import torch

from actors.weights import WeightGate
from broker.embedded import free_port
from common.config import load_config
from common.models import load_causal_lm
from envs.client import EnvClient
from envs.server import EnvServer, serve
from learner.scoring import PolicyScorer
from learner.trainer import Trainer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def cfg(tiny_model):
    return load_config(None, [f"model.path='{tiny_model}'", "actor.max_tokens=6"], environ={})


@pytest.fixture(scope="module")
def engine(cfg, loop):
    from actors.engine import VLLMEngine

    async def start():
        return VLLMEngine(cfg.model, cfg.actor, cfg.model.path, seed=0)

    eng = loop.run_until_complete(start())
    yield eng
    eng.shutdown()


def hf_logprobs(model, tokens):
    """The learner's log-prob of every token given the ones before (position 0: 0)."""
    with torch.no_grad():
        ids = torch.tensor([tokens])
        rows = torch.stack([torch.zeros(len(tokens) - 1, dtype=torch.long), torch.arange(1, len(tokens))], 1)
        logp, _ = PolicyScorer(model)(ids, torch.ones_like(ids), rows, torch.ones(len(rows)))
        return torch.nn.functional.pad(logp, (1, 0))


def test_generation_logprobs_match_the_learner_model(engine, cfg, loop):
    model = load_causal_lm(cfg.model.path)
    prompt = engine.tokenizer.encode("Say a", add_special_tokens=False)

    async def generate_many():
        return await asyncio.gather(*[engine.generate(prompt, 6) for _ in range(16)])

    gens = loop.run_until_complete(generate_many())
    newline = engine.tokenizer.encode("\n", add_special_tokens=False)[0]
    for gen in gens:
        assert 1 <= len(gen.token_ids) <= 6 and len(gen.logprobs) == len(gen.token_ids)
        if gen.finish_reason == "stop":
            assert gen.token_ids[-1] in (newline, engine.tokenizer.eos_token_id)  # kept, as sampled
        ref = hf_logprobs(model, prompt + gen.token_ids)[len(prompt):]
        np.testing.assert_allclose(gen.logprobs, ref.numpy(), atol=2e-3)


def test_weights_reload_in_place(engine, cfg, loop, tmp_path):
    model = load_causal_lm(cfg.model.path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    path = tmp_path / "w.safetensors"
    path.write_bytes(Trainer(model, cfg.learner).weights_blob())
    prompt = engine.tokenizer.encode("Say b", add_special_tokens=False)
    loop.run_until_complete(engine.load_weights(str(path)))
    gen = loop.run_until_complete(engine.generate(prompt, 6))
    ref = hf_logprobs(model, prompt + gen.token_ids)[len(prompt):]
    np.testing.assert_allclose(gen.logprobs, ref.numpy(), atol=2e-3)


def test_episode_is_token_exact(engine, cfg, loop):
    from actors.episode import EpisodeSetup, ModelPolicy, run_episode
    from actors.templates import make_template

    async def scenario():
        port = free_port()
        runner = await serve(EnvServer("letters", {"turns": 3}), "127.0.0.1", port)
        gate = WeightGate(version=7)
        try:
            async with aiohttp.ClientSession() as session:
                client = EnvClient(f"http://127.0.0.1:{port}", session)
                setup = EpisodeSetup(client, engine.tokenizer, cfg.actor, make_template("raw"), "letters")
                policy = ModelPolicy(engine, gate)
                return await asyncio.gather(*[run_episode(setup, policy, task) for task in range(8)])
        finally:
            await runner.cleanup()

    samples = loop.run_until_complete(scenario())
    tok = engine.tokenizer
    for task, s in enumerate(samples):
        assert s.finish_reason == "done" and s.num_turns == 3
        assert s.reward == pytest.approx(float(s.turn_rewards.sum()))
        gen = s.loss_mask.astype(bool)
        assert set(s.versions[gen].tolist()) == {7} and set(s.versions[~gen].tolist()) == {-1}
        assert np.all(s.logprobs[~gen] == 0) and np.all(s.logprobs[gen] < 0)
        # Context runs are exactly the tokenised observations; generated runs sit between them.
        runs, start = [], 0
        for i in range(1, len(s.tokens) + 1):
            if i == len(s.tokens) or gen[i] != gen[start]:
                runs.append((bool(gen[start]), s.tokens[start:i].tolist()))
                start = i
        context = [tok.decode(ids) for is_gen, ids in runs if not is_gen]
        assert context[0].startswith("Say ") and len([r for r in runs if r[0]]) == 3
        for text in context[1:]:
            assert text.startswith("\nSay ")
