"""The trainer on the tiny model: a finite step moves the weights; a non-finite loss or
gradient skips the optimizer step, counted, and leaves the weights as they were."""

import numpy as np
import pytest
import torch

from common.config import LearnerConfig, SFTConfig
from common.models import load_causal_lm
from learner.batch import collate
from tests.groups import synthetic_group


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("poison", ["advantage", "behaviour_logprob"])
def test_non_finite_loss_skips_the_step(tiny_model, poison):
    from learner.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(load_causal_lm(tiny_model), LearnerConfig(minibatches=1))
    rng = np.random.default_rng(0)
    batch = collate([synthetic_group(rng) for _ in range(2)])
    before = weights(trainer.model)
    metrics = trainer.train_step(batch)
    assert metrics["learner/skipped_nonfinite"] == 0
    moved = weights(trainer.model)
    assert any(not torch.equal(before[k], moved[k]) for k in before)
    assert all(p.grad is None for p in trainer.model.parameters())  # freed at once, not held into the next step

    if poison == "advantage":
        batch.advantages[0] = float("inf")
    else:  # the codec refuses these; the guard is the second line of defence
        batch.behav_logprobs[batch.loss_mask > 0] = float("nan")
    metrics = trainer.train_step(batch)
    assert metrics["learner/skipped_nonfinite"] == 1 and trainer.skipped_nonfinite == 1
    after = weights(trainer.model)
    assert all(torch.equal(moved[k], after[k]) for k in moved)
    assert all(p.grad is None for p in trainer.model.parameters())  # nothing carried into the next step


def first_step(model_dir: str, groups, **learner) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The gradients the first optimizer step applies (read by a spy on AdamW.step) and the metrics."""
    from learner.trainer import Trainer
    from tests.groups import sft_examples

    torch.manual_seed(0)
    sft = sft_examples(np.random.default_rng(0), 8) if learner.get("sft_coef") else ()
    trainer = Trainer(load_causal_lm(model_dir), LearnerConfig(**{"minibatches": 1, **learner}),  # one update unless asked
                      sft_examples=sft)
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def spy(*args, **kwargs):
        if not grads:
            grads.update({n: p.grad.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = spy
    return grads, trainer.train_step(collate(groups))


def varied_groups(n: int = 3):
    from tests.groups import varied_group

    rng = np.random.default_rng(11)
    return [varied_group(rng) for _ in range(n)]


def test_micro_batches_give_the_gradients_of_one_batch(tiny_model):
    groups = varied_groups()
    whole, whole_metrics = first_step(tiny_model, groups, max_tokens_per_microbatch=100_000)
    assert whole_metrics["learner/microbatches"] == 1 and whole_metrics["learner/padding_frac"] > 0.2
    for budget in (60, 200):  # one sample per micro-batch; a few per micro-batch
        split, metrics = first_step(tiny_model, groups, max_tokens_per_microbatch=budget)
        assert metrics["learner/microbatches"] > 2
        assert metrics["learner/padding_frac"] < whole_metrics["learner/padding_frac"]  # sorted by length
        assert metrics["learner/loss/policy"] == pytest.approx(whole_metrics["learner/loss/policy"], rel=1e-5, abs=1e-7)
        assert metrics["learner/entropy"] == pytest.approx(whole_metrics["learner/entropy"], rel=1e-5)
        for name, g in whole.items():
            torch.testing.assert_close(split[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert max(float(g.abs().max()) for g in whole.values()) > 1e-3  # there was a gradient to compare


def stale_groups(tiny_model, shift: float = 0.5):
    """varied_groups whose behaviour log-probs are the tiny model's own less `shift` on every other
    generated token: as if older weights had sampled them (the learner's policy now puts more
    mass on half of them)."""
    from learner.trainer import Trainer

    groups = varied_groups()
    trainer = Trainer(load_causal_lm(tiny_model), LearnerConfig(minibatches=1))
    batch = collate(groups)
    trainer._before_update(batch, [list(range(len(batch.tokens)))], policy=True)
    samples = [s for g in groups for s in g.samples]
    for i, s in enumerate(samples):
        own = batch.prox_logprobs[i, :len(s.tokens)].numpy()
        gen = np.flatnonzero(s.loss_mask)[1:]  # the first token is never scored
        s.logprobs[gen] = own[gen] - shift * (np.arange(gen.size) % 2)
    return groups


def test_each_correction_acts_on_stale_samples_and_the_trust_region_needs_several_updates(tiny_model):
    groups = stale_groups(tiny_model)
    # decoupled, one update: no proximal pass, so no trust region (the ratio is its own weights' over
    # themselves); the stale tokens are weighted by exp(lp - lb) = e^0.5 on half the tokens.
    _, one = first_step(tiny_model, groups)
    assert "learner/time/proximal_s" not in one and one["learner/updates"] == 1
    w = np.array([1.0, np.exp(0.5)])  # the two weights, on about half the tokens each
    assert one["learner/frac_clipped"] == 0 and one["learner/ess"] == pytest.approx(w.mean() ** 2 / (w ** 2).mean(),
                                                                                   abs=0.02)
    assert one["learner/mismatch_kl"] == pytest.approx((np.exp(0.5) - 1.5) / 2, rel=0.15)  # k3 of 0.5 on half
    # naive: the ratio against the behaviour policy, so the clip acts on the first update already:
    # e^0.5 = 1.65 is past 1.2 on half the tokens, and clips the half of those with A > 0
    _, naive = first_step(tiny_model, groups, loss="naive")
    assert 0.15 < naive["learner/frac_clipped"] < 0.35 and naive["learner/ratio_mean"] > 1.2
    # tis: weights exp(lc - lb) capped at behav_weight_cap (1.5 here): the shifted half truncated
    _, tis = first_step(tiny_model, groups, loss="tis", behav_weight_cap=1.5)
    assert "learner/time/proximal_s" not in tis and 0.4 < tis["learner/frac_truncated"] < 0.6
    # decoupled, several updates: the proximal pass, and the later updates move the ratio out of [0.8, 1.2]
    _, several = first_step(tiny_model, groups, ppo_epochs=2, minibatches=2, lr=3e-3)
    assert several["learner/time/proximal_s"] > 0 and several["learner/updates"] == 4
    assert several["learner/frac_clipped"] > 0.05 and several["learner/ratio_mean"] != pytest.approx(1.0)
    # naive and tis never use the proximal log-probs: no pass for them, however many updates
    _, naive_several = first_step(tiny_model, groups, loss="naive", minibatches=2)
    assert "learner/time/proximal_s" not in naive_several and naive_several["learner/updates"] == 2


def test_more_minibatches_than_samples_step_only_on_samples(tiny_model):
    groups = varied_groups(1)  # 4 samples
    _, metrics = first_step(tiny_model, groups, minibatches=10, ppo_epochs=2)
    assert metrics["learner/updates"] == 2 * 4  # one sample per minibatch; the 6 empty ones are not steps


def one_layer_qwen():
    """A Qwen2 of one layer, its output layer tied to the embeddings, seeded: the same weights each call."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=90, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))


def test_tied_output_layer_is_published_once_in_a_file_safetensors_reads(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from learner.trainer import Trainer

    model = one_layer_qwen()
    trainer = Trainer(model, LearnerConfig(minibatches=1))
    path = tmp_path / "w.safetensors"
    assert trainer.save_weights(path, torch.bfloat16) == path.stat().st_size  # written a tensor at a time
    weights = load_file(path)  # safetensors checks the header's offsets against the file
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
    state = {k: v.cpu().to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}  # on a GPU too
    assert weights.keys() == state.keys() and all(torch.equal(weights[k], state[k]) for k in state)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses a file without it
    trainer.train_step(collate(varied_groups(1)))
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight  # still tied after a step
    model_state = trainer.parallel.train_state(trainer.scorer, trainer.optimizer)["model"]
    assert "lm.lm_head.weight" not in model_state and "lm.model.embed_tokens.weight" in model_state  # saved once


def test_a_checkpoint_written_in_the_background_holds_its_step_while_training_goes_on(tmp_path, monkeypatch):
    """learner.checkpoint_async: the state is copied when the checkpoint is taken and written from
    a thread while the next step trains. The write is held until that step is done, so a
    checkpoint written from the live tensors (no copy) would hold the later step's weights; it
    must resume a fresh trainer with the model and AdamW state of the step it was taken at."""
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    from learner.checkpoint import begin, read_model
    from learner.trainer import Trainer

    trainer = Trainer(one_layer_qwen(), LearnerConfig(lr=1e-2))
    trainer.train_step(collate(varied_groups(1)))  # AdamW's moments exist
    taken = torch.utils._pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x,
                                         (dict(trainer.scorer.state_dict()), trainer.optimizer.state_dict()))
    gate, write = threading.Event(), FileSystemWriter.write_data
    monkeypatch.setattr(FileSystemWriter, "write_data", lambda *a, **kw: gate.wait(60) and write(*a, **kw))
    path = begin(tmp_path, 1)
    future = trainer.save_checkpoint(path, background=True)
    trainer.train_step(collate(varied_groups(1)))
    gate.set()
    future.result(timeout=60)

    moved = [k for k, v in trainer.scorer.state_dict().items() if not torch.equal(v, taken[0][k])]
    assert moved, "the step changed no weight: the checks below could not fail"
    saved = read_model(path)
    assert saved.keys() == taken[0].keys() - {"lm.lm_head.weight"}  # the tied output layer once
    assert all(torch.equal(v, taken[0][k].cpu()) for k, v in saved.items())  # read to the CPU, also on a GPU
    resumed = Trainer(one_layer_qwen(), LearnerConfig(lr=1e-2))
    resumed.load_checkpoint(path)
    assert all(torch.equal(v, taken[0][k]) for k, v in resumed.scorer.state_dict().items())
    flat, _ = torch.utils._pytree.tree_flatten(resumed.optimizer.state_dict()["state"])
    flat_taken, _ = torch.utils._pytree.tree_flatten(taken[1]["state"])
    assert len(flat) == len(flat_taken) > 0
    assert all(torch.equal(a, b) for a, b in zip(flat, flat_taken) if isinstance(a, torch.Tensor))


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_proximal_pass_covers_each_ranks_samples_in_fewer_fuller_forwards(ranks):
    """The no-grad pass before the first update cuts each rank's samples of every minibatch
    together: the same samples the rank trains, in no more forwards than minibatch by minibatch,
    as many on every rank (FSDP2's forwards are collectives), each within the token budget."""
    from learner.batch import microbatches, plan, whole_passes

    batch = collate(varied_groups(4))
    budget = 8 * int(batch.lengths.max())  # room for eight of the longest samples in a forward
    steps = plan(batch, 4, ranks, budget)
    passes = whole_passes(steps, batch.lengths, ranks, budget)
    assert len({len(p) for p in passes}) == 1
    per_minibatch = max(sum(len([m for m in mb[r] if m]) for mb in steps.minibatches) for r in range(ranks))
    assert len(passes[0]) < per_minibatch  # four minibatches' worth of small forwards merged
    for r in range(ranks):
        trained = sorted(i for mb in steps.minibatches for micro in mb[r] for i in micro)
        assert sorted(i for micro in passes[r] for i in micro) == trained
        assert all(len(m) * int(batch.lengths[m].max()) <= budget for m in passes[r] if len(m) > 1)
    assert microbatches([], batch.lengths, budget) == []


def test_the_proximal_log_probs_are_the_models_own_at_the_first_update(tiny_model):
    """With the proximal pass cut differently from the updates, every generated token still gets
    the log-prob of the weights before the first update, in its own row: the first minibatch's
    ratio is 1 (the clip acts only from the second update on)."""
    from learner.trainer import Trainer

    groups = varied_groups(4)
    torch.manual_seed(0)
    trainer = Trainer(load_causal_lm(tiny_model), LearnerConfig(minibatches=4, max_tokens_per_microbatch=200))
    batch = collate(groups)
    trainer.train_step(batch)  # fills batch.prox_logprobs, then updates
    reference = Trainer(load_causal_lm(tiny_model), LearnerConfig(minibatches=1))
    one_by_one = collate(groups)
    reference._before_update(one_by_one, [[i] for i in range(len(one_by_one.lengths))], policy=True)
    generated = batch.generated_mask.bool()
    assert generated.sum() > 100
    torch.testing.assert_close(batch.prox_logprobs[generated], one_by_one.prox_logprobs[generated], rtol=1e-4, atol=1e-5)


def test_a_batch_trained_before_brings_nothing_of_that_step(tiny_model):
    """A Batch that a trust-region step filled with its proximal log-probs, given to a trainer of
    one update: that step must not use them (its ratio is its own weights' over themselves)."""
    from learner.trainer import Trainer

    groups = varied_groups(2)
    torch.manual_seed(0)
    first = Trainer(load_causal_lm(tiny_model), LearnerConfig(minibatches=4, lr=1e-2))
    first.train_step(collate(groups))  # its weights move away from the model's
    reused = collate(groups)
    first.train_step(reused)
    assert reused.prox_logprobs is not None  # what the later step must ignore
    metrics = {}
    for name, batch in (("reused", reused), ("fresh", collate(groups))):
        torch.manual_seed(0)
        metrics[name] = Trainer(load_causal_lm(tiny_model), LearnerConfig(minibatches=1)).train_step(batch)
    assert metrics["reused"]["learner/ratio_mean"] == pytest.approx(1.0)
    for key in ("learner/loss/policy", "learner/ratio_mean", "learner/frac_clipped", "learner/grad_norm"):
        assert metrics["reused"][key] == pytest.approx(metrics["fresh"][key], rel=1e-6), key


def test_the_learning_rate_warms_up_over_its_steps_and_a_resumed_run_goes_on_from_where_it_was(tmp_path):
    """learner.lr_warmup_steps = 2 with 2 minibatches: the 4 updates of the first two steps take
    lr/4, lr/2, 3lr/4 and lr, and later ones lr; a trainer resumed from a checkpoint of step 1
    goes on at 3lr/4, not at lr/4 again."""
    from learner.checkpoint import begin
    from learner.trainer import Trainer

    def trainer():
        made = Trainer(one_layer_qwen(), LearnerConfig(lr=1e-2, lr_warmup_steps=2, minibatches=2))
        seen, step = [], made.optimizer.step

        def spy(*args, **kwargs):
            seen.append(made.optimizer.param_groups[0]["lr"])
            return step(*args, **kwargs)

        made.optimizer.step = spy
        return made, seen

    first, lrs = trainer()
    batch = collate(varied_groups(2))
    assert first.train_step(batch)["learner/lr"] == pytest.approx(0.5e-2)
    path = begin(tmp_path, 1)
    first.save_checkpoint(path, background=False).result(timeout=60)
    for _ in range(2):
        first.train_step(batch)
    assert lrs == pytest.approx([0.25e-2, 0.5e-2, 0.75e-2, 1e-2, 1e-2, 1e-2])
    resumed, resumed_lrs = trainer()
    resumed.load_checkpoint(path)
    resumed_lrs.clear()  # the load's own step at lr 0, which makes AdamW's state to load into
    resumed.train_step(batch)
    assert resumed_lrs == pytest.approx([0.75e-2, 1e-2])


def test_the_supervised_term_is_its_episodes_mean_nll_and_lowers_it(tiny_model, tmp_path):
    """learner.sft_coef: beside the RL loss, the NLL per trained token of learner.sft_episodes episodes
    of learner.sft_data. Its first value is what SFT's own evaluation gives the same episodes on the
    same weights; over five steps it falls, where with a negligible weight RL alone leaves it. A
    batch without signal (and no entropy bonus) still trains the term."""
    from learner.sft import SFTTrainer
    from learner.trainer import Trainer
    from tests.groups import multi_turn_group, sft_examples, varied_group

    rng = np.random.default_rng(11)
    examples = sft_examples(rng, 10)
    batches = [collate([varied_group(rng) for _ in range(2)]) for _ in range(5)]
    cfg = LearnerConfig(sft_coef=1.0, sft_data=["unused"], sft_episodes=64, lr=3e-3, minibatches=1, entropy_coef=0.0)
    expected = SFTTrainer(load_causal_lm(tiny_model), cfg, SFTConfig(), 1).evaluate(examples)
    curves = {}
    for coef in (1.0, 1e-6):
        torch.manual_seed(0)
        trainer = Trainer(load_causal_lm(tiny_model), cfg.model_copy(update={"sft_coef": coef}), sft_examples=examples)
        curves[coef] = [trainer.train_step(batch)["learner/loss/sft"] for batch in batches]
    assert curves[1.0][0] == pytest.approx(expected, rel=1e-5) and curves[1e-6][0] == pytest.approx(expected, rel=1e-5)
    dropped, control = curves[1.0][0] - curves[1.0][-1], abs(curves[1e-6][0] - curves[1e-6][-1])
    assert dropped > 0.1 and dropped > 5 * control, curves
    flat = collate([multi_turn_group(rng, [([0.0], ["a"]), ([0.0], ["b"])])])
    assert flat.num_trained_tokens == 0 and trainer.train_step(flat)["learner/loss/sft"] > 0


def test_the_supervised_terms_files_are_checked_at_the_start(tiny_model, tmp_path):
    """learner.sft_data must hold trajectory files whose tokens fit the policy's vocabulary; each
    failure names the field and the fix. learner.sft_coef without files fails in the config."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pydantic import ValidationError

    from common.config import Config
    from learner.sft import read_examples

    good, wide = tmp_path / "good.parquet", tmp_path / "wide.parquet"
    pq.write_table(pa.table({"tokens": [[1, 2, 3, 4]], "loss_mask": [[0, 0, 1, 1]]}), good)
    pq.write_table(pa.table({"tokens": [[1, 2, 300]], "loss_mask": [[0, 1, 1]]}), wide)
    [(tokens, mask)] = read_examples([str(good)], 100)
    assert tokens.tolist() == [1, 2, 3, 4] and mask.tolist() == [0, 0, 1, 1]
    for path, words in ((wide, "token id 300, outside the policy's vocabulary (100)"),
                        (tmp_path / "none.parquet", "omrl collect"), (good, "4 tokens, more than the model's 3")):
        with pytest.raises(ValueError, match="learner.sft_data") as failed:
            read_examples([str(path)], 100, positions=3)
        assert words in str(failed.value)
    with pytest.raises(ValidationError, match="learner.sft_data"):
        Config.model_validate({"learner": {"sft_coef": 0.1}})


def test_a_batch_with_masked_turns_is_scored_over_each_token_s_allowed_tokens(tiny_model):
    """Samples carrying Sample.allowed (actor.constrain_actions) beside one without: through
    collate and the micro-batches, each masked token is scored over its own allowed tokens, every
    other over the vocabulary, as the full logits give them."""
    from learner.scoring import PolicyScorer
    from tests.groups import mask_generated

    rng = np.random.default_rng(7)
    group = synthetic_group(rng)
    masked = {id(s): mask_generated(s, rng) for s in group.samples[:3]}  # the last sample unmasked
    batch = collate([group])
    model = load_causal_lm(tiny_model, "float32")
    mb = batch.micro([3, 0, 2, 1], torch.device("cpu"))
    with torch.no_grad():
        logp, entropy, _ = PolicyScorer(model)(mb.tokens, mb.attention_mask, mb.rows, mb.temperature, mb.allowed)
        logits = model(input_ids=mb.tokens).logits.float()
    order = [3, 0, 2, 1]
    for k, (n, t) in enumerate(mb.rows.tolist()):
        row = logits[n, t - 1]
        ids = masked.get(id(group.samples[order[n]]), {}).get(t)
        allowed = torch.as_tensor(ids, dtype=torch.long) if ids is not None else torch.arange(row.shape[0])
        want = torch.log_softmax(row[allowed], 0)
        target = int(mb.tokens[n, t])
        assert logp[k].item() == pytest.approx(want[(allowed == target).nonzero()[0, 0]].item(), abs=1e-5)
        assert entropy[k].item() == pytest.approx(-(want.exp() * want).sum().item(), abs=1e-5)
    assert sum(1 for ids in (masked.get(id(group.samples[order[n]]), {}).get(t) for n, t in mb.rows.tolist())
               if ids is not None) == 9  # 3 masked tokens in each of 3 samples


def test_only_the_samples_the_loss_reads_are_scored(tiny_model):
    """A group without signal has loss mask 0: with no term over every generated token its samples
    are not scored, and the step's gradient is the one of the groups with signal alone. With the
    entropy bonus on, every sample is scored (the bonus reads groups without signal too)."""
    from tests.groups import varied_group

    rng = np.random.default_rng(5)
    signal = varied_groups(2)
    flat = varied_group(rng)
    for s in flat.samples:
        s.reward = 1.0
    assert collate([flat]).num_trained_tokens == 0
    alone, alone_metrics = first_step(tiny_model, signal, entropy_coef=0.0)
    mixed, mixed_metrics = first_step(tiny_model, [signal[0], flat, signal[1]], entropy_coef=0.0)
    assert alone_metrics["learner/scored_frac"] == 1.0 and mixed_metrics["learner/scored_frac"] == pytest.approx(2 / 3)
    assert mixed_metrics["learner/loss/policy"] == pytest.approx(alone_metrics["learner/loss/policy"], rel=1e-5)
    for name, g in alone.items():
        torch.testing.assert_close(mixed[name], g, rtol=1e-4, atol=1e-6, msg=name)
    _, bonus = first_step(tiny_model, [signal[0], flat, signal[1]], entropy_coef=0.01)
    assert bonus["learner/scored_frac"] == 1.0
