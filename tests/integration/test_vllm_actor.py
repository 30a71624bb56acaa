"""A real vLLM engine on the tiny model: log-probs agree with the learner's model, weights
reload in place, and the episode loop keeps tokens exactly as sampled."""

import asyncio
import os

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
from tests.procs import descendants

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

    async def start():  # with the choices' logits processor, which requests without choices never meet
        return VLLMEngine(cfg.model, cfg.actor.model_copy(update={"constrain_actions": True}), cfg.model.path, seed=0)

    async def stop():  # in the loop: vLLM closes its sockets there, and a zmq context with open ones hangs in term()
        eng.shutdown()

    eng = loop.run_until_complete(start())
    yield eng
    loop.run_until_complete(stop())


def hf_logprobs(model, tokens):
    """The learner's log-prob of every token given the ones before (position 0: 0)."""
    with torch.no_grad():
        ids = torch.tensor([tokens])
        rows = torch.stack([torch.zeros(len(tokens) - 1, dtype=torch.long), torch.arange(1, len(tokens))], 1)
        logp, _, _ = PolicyScorer(model)(ids, torch.ones_like(ids), rows, torch.ones(len(rows)))
        return torch.nn.functional.pad(logp, (1, 0))


def test_the_engine_runs_its_worker_in_the_engine_core_process(engine):
    """On CPU one process for the engine (actors.engine.UNIPROC), not an engine core and a
    worker that imports torch and vLLM again and spins after every message."""
    vllm = [title for title in descendants(os.getpid()) if title.startswith("VLLM::")]
    assert vllm == ["VLLM::EngineCore"], vllm  # with a worker of its own: also "VLLM::Worker"


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
    Trainer(model, cfg.learner).save_weights(path)
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
    for s in samples:
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
        assert context[0].startswith("U: Say ") and len([r for r in runs if r[0]]) == 3  # the tiny chat template
        for (_, generated), text in zip(runs[1::2], context[1:]):
            # The template's end of turn ("\n") goes in as context after a turn that ended otherwise (EOS).
            suffix = "" if tok.decode(generated).endswith("\n") else "\n"
            assert text.startswith(suffix + "U: \nSay ")


def test_a_constrained_turn_is_one_of_its_choices_with_the_masked_distribution_s_logprobs(engine, cfg, loop, tmp_path):
    """actor.constrain_actions: sampled turns are one of the choices, each token's log-prob the
    learner's model renormalised over the tokens the choices allow after its prefix (the engine
    logs the distribution it sampled from); one choice is the only turn even greedily."""
    from actors.choices import Choices

    model = load_causal_lm(cfg.model.path)
    Trainer(model, cfg.learner).save_weights(tmp_path / "w.safetensors")
    loop.run_until_complete(engine.load_weights(str(tmp_path / "w.safetensors")))  # earlier tests load others
    tok = engine.tokenizer
    prompt = tok.encode("U: Say a", add_special_tokens=False)
    sequences = [tok.encode(text, add_special_tokens=False) for text in ("b\n", "bc\n", "dd\n", "cab\n")]
    choices = Choices.of(sequences)

    async def generate_many():
        return await asyncio.gather(*[engine.generate(prompt, 6, choices=choices) for _ in range(24)])

    gens = loop.run_until_complete(generate_many())
    assert all(gen.token_ids in sequences for gen in gens) and len({tuple(g.token_ids) for g in gens}) >= 2
    for gen in gens:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + gen.token_ids])).logits[0].float()
        for k, token in enumerate(gen.token_ids):
            row = logits[len(prompt) + k - 1]
            allowed = choices.allowed(gen.token_ids[:k])
            want = (row[token] - torch.logsumexp(row[allowed], 0)).item()
            assert gen.logprobs[k] == pytest.approx(want, abs=2e-3)
    only = loop.run_until_complete(engine.generate(prompt, 6, temperature=0, choices=Choices.of(sequences[3:])))
    assert only.token_ids == sequences[3] and only.finish_reason == "stop"
    free = loop.run_until_complete(engine.generate(prompt, 6, temperature=0))  # no choices: not masked
    assert free.token_ids != sequences[3]


def test_constrained_episodes_play_only_the_env_s_actions_and_the_learner_scores_what_the_engine_sampled(
        engine, cfg, loop, tmp_path):
    """The episode loop asks the env for its actions every turn (`/actions`) and the turn is one
    of them as the format writes it: every action of a random model is a letter of the env. Each
    sample carries what the mask let through, and the learner's log-probs of its tokens are the
    engine's (the masked distribution's), where the whole vocabulary's are far from them."""
    from actors.episode import EpisodeSetup, ModelPolicy, run_episode
    from actors.templates import make_template
    from common.messages import RolloutGroup
    from learner.batch import collate

    model = load_causal_lm(cfg.model.path, "float32")
    Trainer(model, cfg.learner).save_weights(tmp_path / "w.safetensors")
    loop.run_until_complete(engine.load_weights(str(tmp_path / "w.safetensors")))
    actor = cfg.actor.model_copy(update={"constrain_actions": True})

    async def scenario():
        port = free_port()
        runner = await serve(EnvServer("letters", {"turns": 3, "alphabet": "xyz"}), "127.0.0.1", port)
        try:
            async with aiohttp.ClientSession() as session:
                client = EnvClient(f"http://127.0.0.1:{port}", session)
                setup = EpisodeSetup(client, engine.tokenizer, actor, make_template("raw"), "letters")
                transcripts = [[] for _ in range(8)]
                samples = await asyncio.gather(*[run_episode(setup, ModelPolicy(engine, WeightGate(version=0)), task,
                                                             transcripts[task]) for task in range(8)])
                return transcripts, samples
        finally:
            await runner.cleanup()

    transcripts, samples = loop.run_until_complete(scenario())
    actions = [turn["value"] for t in transcripts for turn in t if turn["from"] == "gpt"]
    assert len(actions) == 24 and {a.strip() for a in actions} <= set("xyz")
    assert all(s.allowed is not None and (s.allowed_counts[s.loss_mask == 1] > 0).any() for s in samples)
    batch = collate([RolloutGroup("0", "letters", "test", {"temperature": actor.temperature}, samples)])
    mb = batch.micro(list(range(len(samples))), torch.device("cpu"))
    scorer = PolicyScorer(model)
    with torch.no_grad():
        masked, _, _ = scorer(mb.tokens, mb.attention_mask, mb.rows, mb.temperature, mb.allowed)
        whole, _, _ = scorer(mb.tokens, mb.attention_mask, mb.rows, mb.temperature)
    assert (masked - mb.behav_logprobs).abs().max().item() < 2e-3
    assert (whole - mb.behav_logprobs).abs().max().item() > 0.5  # the check can fail: unmasked is far off


def perturbed(path: str, scale: float, seed: int):
    model = load_causal_lm(path)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def test_an_update_interrupts_a_turn_which_continues_on_the_new_weights(engine, cfg, loop, tmp_path):
    """interrupt mode: an update lands while a turn generates; the turn keeps the tokens it had
    (version 0, log-probs of the old weights) and continues on the new ones (version 1, log-probs
    of the new weights, over the whole buffer as the learner scores it). A turn that ends before
    the update lands is tried again (the model may stop at once)."""
    from actors.episode import ModelPolicy

    old, new = load_causal_lm(cfg.model.path), perturbed(cfg.model.path, 0.5, seed=1)
    old_path, new_path = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    Trainer(old, cfg.learner).save_weights(old_path)
    Trainer(new, cfg.learner).save_weights(new_path)
    prompt = engine.tokenizer.encode("U: Say c", add_special_tokens=False)

    async def attempt():
        await engine.load_weights(str(old_path))
        gate = WeightGate(0, pause=engine.pause, resume=engine.resume)
        turn = asyncio.create_task(ModelPolicy(engine, gate).act(prompt, 120, env_id=0))
        await asyncio.sleep(0.05)
        await gate.apply(1, lambda: engine.load_weights(str(new_path)))
        return await turn, gate

    engine.set_stop(["\n"])
    for _ in range(8):
        turn, gate = loop.run_until_complete(attempt())
        if 0 in turn.version and 1 in turn.version:
            break
    else:
        pytest.fail("no turn was still generating when the update landed in 8 tries")
    versions = np.asarray(turn.version)
    cut = int(np.argmax(versions == 1))
    assert (versions[:cut] == 0).all() and (versions[cut:] == 1).all() and cut > 0  # tokens kept, in order
    ids = turn.generation.token_ids
    assert len(turn.generation.logprobs) == len(ids) <= 120
    full = prompt + ids
    lp = np.asarray(turn.generation.logprobs)
    np.testing.assert_allclose(lp[:cut], hf_logprobs(old, full)[len(prompt):][:cut].numpy(), atol=2e-3)
    np.testing.assert_allclose(lp[cut:], hf_logprobs(new, full)[len(prompt):][cut:].numpy(), atol=2e-3)
    assert gate.update_s < 5.0


def test_a_kept_update_goes_on_in_the_same_request_with_exact_versions(engine, cfg, loop, tmp_path):
    """keep mode: an update lands while a turn generates; the request is not aborted (one engine
    call, no continuation), and the engine's count of its tokens at the swap cuts them exactly:
    before it the old weights' log-probs, from the first token after it not (the new weights,
    sampling over the KV the old ones computed)."""
    from actors.episode import ModelPolicy
    from actors.weights import update_gate

    old, new = load_causal_lm(cfg.model.path), perturbed(cfg.model.path, 0.5, seed=1)
    old_path, new_path = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    Trainer(old, cfg.learner).save_weights(old_path)
    Trainer(new, cfg.learner).save_weights(new_path)
    prompt = engine.tokenizer.encode("U: Say c", add_special_tokens=False)

    class Counting:
        def __init__(self):
            self.calls = 0

        async def generate(self, *args, **kwargs):
            self.calls += 1
            return await engine.generate(*args, **kwargs)

    async def run():
        await engine.load_weights(str(old_path))
        gate, counting = update_gate("keep", engine), Counting()
        turn = asyncio.create_task(ModelPolicy(counting, gate).act(prompt, 120, env_id=0))
        await asyncio.sleep(0.1)
        await gate.apply(1, lambda: engine.load_weights(str(new_path)))
        return await turn, gate, counting.calls

    engine.set_stop([])
    engine.params["ignore_eos"] = True  # the turn runs its 120 tokens: the update lands inside it
    try:
        for _ in range(8):  # the update may land before the first token
            turn, gate, calls = loop.run_until_complete(run())
            if 0 in turn.version and 1 in turn.version:
                break
        else:
            pytest.fail("no turn had a token of each version in 8 tries")
    finally:
        engine.params.pop("ignore_eos")
        engine.set_stop(cfg.actor.stop)
    versions = np.asarray(turn.version)
    cut = int(np.argmax(versions == 1))
    assert calls == 1 and turn.generation.finish_reason == "length" and len(turn.generation.token_ids) == 120
    assert 0 < cut < 120 and (versions[:cut] == 0).all() and (versions[cut:] == 1).all()
    lp = np.asarray(turn.generation.logprobs)
    old_lp = hf_logprobs(old, prompt + turn.generation.token_ids)[len(prompt):].numpy()
    np.testing.assert_allclose(lp[:cut], old_lp[:cut], atol=2e-3)
    assert abs(lp[cut] - old_lp[cut]) > 1e-2  # the first token of the new version is the new weights'
    assert gate.update_s < 5.0


def test_a_stop_string_of_several_tokens_ends_the_turn_with_its_tokens_as_sampled(engine, cfg, loop):
    """Greedy, so the continuation is known: a stop sequence taken from the middle of it ends
    the generation right after its first occurrence, through the streaming (DELTA) path; with a
    continuation (turn_start) the sequence may begin in tokens generated before."""
    prompt = engine.tokenizer.encode("U: Say d", add_special_tokens=False)
    try:
        engine.set_stop([])
        free = loop.run_until_complete(engine.generate(prompt, 24, temperature=0.0)).token_ids
        assert len(free) == 24
        stop = engine.tokenizer.decode(free[6:9])
        first = next(i for i in range(len(free)) if engine.tokenizer.decode(free[i:i + 3]) == stop)
        engine.set_stop([stop])
        assert engine.stops == [stop]
        gen = loop.run_until_complete(engine.generate(prompt, 24, temperature=0.0))
        assert gen.token_ids == free[:first + 3] and gen.finish_reason == "stop"
        assert len(gen.logprobs) == len(gen.token_ids)
        # A continuation whose first new token completes the stop sequence begun before it.
        head = free[:first + 2]
        cont = loop.run_until_complete(engine.generate(prompt + head, 24, temperature=0.0, turn_start=len(prompt)))
        assert cont.token_ids == [free[first + 2]] and cont.finish_reason == "stop"
    finally:
        engine.set_stop(cfg.actor.stop)


def test_an_agent_through_the_openai_endpoint_is_trained_on_exactly_what_vllm_sampled(engine, cfg, loop, tmp_path):
    """Two chat turns of the official `openai` client through the gateway (actors/gateway.py) on
    this engine, then a third that drops the history (a new segment, as a template that rewrites
    history or an agent that edits its memory makes one): every segment the session captured
    holds the sampled tokens with the engine's
    log-probs, which the learner's model gives back (within 2e-3 per token, below 1e-3 on
    average, in fp32). The actor's stop strings ("\n") do not apply: the request has none."""
    openai = pytest.importorskip("openai")
    from aiohttp import web

    from actors.episode import ModelPolicy
    from actors.gateway import Gateway

    model = load_causal_lm(cfg.model.path)  # the engine's weights: other tests of this module load others
    Trainer(model, cfg.learner).save_weights(tmp_path / "w.safetensors")
    loop.run_until_complete(engine.load_weights(str(tmp_path / "w.safetensors")))
    gateway = Gateway(engine, ModelPolicy(engine, WeightGate(0)), cfg.actor.max_seq_len, "tiny")
    session = gateway.open("agent")

    async def agent():
        runner = web.AppRunner(gateway.app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            llm = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/sessions/agent/v1", api_key="-", max_retries=0)
            messages = [{"role": "user", "content": "Say a"}]
            replies = []
            for ask in ("Say b", "forget", None):
                reply = await llm.chat.completions.create(model="tiny", messages=messages, max_tokens=8, logprobs=True)
                replies.append(reply)
                if ask == "forget":
                    messages = [{"role": "user", "content": "Say c"}]
                elif ask:
                    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                                 {"role": "user", "content": ask}]
            return replies
        finally:
            await runner.cleanup()

    replies = loop.run_until_complete(agent())
    assert session.calls == 3 == 1 + session.extended + session.splits and session.splits >= 1
    assert len(session.segments) == 1 + session.splits >= 2
    sampled = 0
    for segment in session.segments:
        mask = np.asarray(segment.loss_mask, bool)
        ref = hf_logprobs(model, segment.tokens).numpy()[mask]
        behaviour = np.asarray(segment.logprobs, np.float32)[mask]
        assert np.max(np.abs(behaviour - ref)) < 2e-3 and abs(float(np.mean(behaviour - ref))) < 1e-3
        assert set(np.asarray(segment.versions)[mask]) == {0}
        sampled += int(mask.sum())
    assert sampled == sum(r.usage.completion_tokens for r in replies)
    assert [t.logprob for t in replies[-1].choices[0].logprobs.content] == pytest.approx(
        list(np.asarray(session.segments[-1].logprobs)[np.asarray(session.segments[-1].loss_mask, bool)][-len(
            replies[-1].choices[0].logprobs.content):]), abs=1e-6)
