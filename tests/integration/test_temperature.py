"""Behaviour log-probs are those of the distribution vLLM sampled from (after temperature),
and the learner's scorer gives the same numbers for the same tokens at the same temperature."""

import asyncio
import shutil

import pytest
import torch

from common.config import load_config
from common.models import load_causal_lm
from learner.scoring import PolicyScorer

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.7
HEAD_SCALE = 10.0
"""The tiny model's logits are nearly uniform (std 0.2), so temperature barely moves its
distribution; scaling the output layer makes it peaked enough (entropy about 2 nats at 0.7)
that scoring at the wrong temperature shows."""


@pytest.fixture(scope="module")
def sharp_model(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharp-model")
    shutil.copytree(tiny_model, out, dirs_exist_ok=True)  # tokenizer files
    lm = load_causal_lm(tiny_model)
    with torch.no_grad():
        lm.get_output_embeddings().weight.mul_(HEAD_SCALE)
    lm.save_pretrained(out, safe_serialization=True)
    return str(out)


@pytest.fixture(scope="module")
def sampled(sharp_model):
    """(prompts, generations): 8 prompts x up to 32 tokens at TEMPERATURE, one engine start."""
    from actors.engine import VLLMEngine

    cfg = load_config(None, [f"model.path='{sharp_model}'", "model.dtype='float32'", "actor.stop=[]",
                             "actor.max_tokens=32"], environ={})

    async def run():
        engine = VLLMEngine(cfg.model, cfg.actor, cfg.model.path, seed=0)
        try:
            prompts = [engine.tokenizer.encode(f"Say {c}", add_special_tokens=False) for c in "abcdefgh"]
            gens = await asyncio.gather(*[engine.generate(p, cfg.actor.max_tokens, TEMPERATURE) for p in prompts])
            return prompts, gens
        finally:
            engine.shutdown()

    return asyncio.run(run())


def learner_logprobs(model_path, prompts, gens, temperature):
    """The learner's log-prob of every generated token, flat in (sample, position) order."""
    seqs = [p + g.token_ids for p, g in zip(prompts, gens)]
    T = max(map(len, seqs))
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)  # (N, T), right-padded
    attention_mask = torch.zeros_like(tokens)
    for n, seq in enumerate(seqs):
        tokens[n, :len(seq)], attention_mask[n, :len(seq)] = torch.tensor(seq), 1
    rows = torch.tensor([(n, t) for n, (p, g) in enumerate(zip(prompts, gens))
                         for t in range(len(p), len(p) + len(g.token_ids))])  # (M, 2)
    scorer = PolicyScorer(load_causal_lm(model_path, "float32"))
    with torch.no_grad():
        logp, _, _ = scorer(tokens, attention_mask, rows, torch.full((len(rows),), temperature))
    return logp


def mismatch_kl(learner_logp, behav_logprobs):
    """k3 estimate of KL(behaviour || learner) on tokens drawn from the behaviour policy."""
    d = learner_logp.double() - behav_logprobs.double()
    return (d.exp() - d - 1).mean().item()


def test_learner_scores_tokens_as_vllm_sampled_them(sampled, sharp_model):
    prompts, gens = sampled
    behav_logprobs = torch.tensor([lp for g in gens for lp in g.logprobs])
    assert len(behav_logprobs) > 100 and torch.all(behav_logprobs <= 0)

    kl_same = mismatch_kl(learner_logprobs(sharp_model, prompts, gens, TEMPERATURE), behav_logprobs)
    kl_raw = mismatch_kl(learner_logprobs(sharp_model, prompts, gens, 1.0), behav_logprobs)
    print(f"mismatch KL: {kl_same:.3g} at {TEMPERATURE}, {kl_raw:.3g} at 1.0")
    assert kl_same < 1e-3
    # Scoring at the raw temperature must be caught: if either side ignored the temperature,
    # the first figure would be this large.
    assert kl_raw > 2e-2
