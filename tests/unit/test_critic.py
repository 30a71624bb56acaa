"""The learner's estimators beyond GRPO on hand-made multi-turn samples: rewards placed at
turn ends, GiGPO's step advantages in a batch, PPO with a value head (its loss falls, it is
checkpointed and never published), the naive loss, the KL penalty and Dr.GRPO's token sum."""

import numpy as np
import pytest
import torch

from common.config import Config, LearnerConfig
from common.messages import decode_group, encode_group
from common.models import load_causal_lm
from learner.algorithms import discounted_returns, gigpo_step_advantages
from learner.batch import collate, turn_spans
from learner.checkpoint import begin
from tests.groups import multi_turn_group, multi_turn_sample, varied_group

EPISODES = [([0.0, 0.0, 1.0], ["a", "b", "c"]), ([0.0, 1.0], ["a", "c"]), ([0.0, 0.0, 0.0, 0.0], ["a", "b", "d", "b"])]


def test_turn_rewards_sit_on_each_turns_last_token_and_sum_to_the_reward():
    rng = np.random.default_rng(0)
    s = multi_turn_sample(rng, [0.5, 0.0, 1.0], ["a", "b", "c"], reward=2.0)  # reward functions add 0.5
    assert turn_spans(s.loss_mask) == [(4, 7), (11, 14), (18, 21)]
    group = multi_turn_group(rng, EPISODES[:2])
    group.samples[0] = s
    batch = collate([group], "ppo")
    np.testing.assert_allclose(batch.token_rewards[0, [6, 13, 20]].numpy(), [0.5, 0.0, 1.5])
    assert float(batch.token_rewards[0].sum()) == pytest.approx(2.0)
    assert torch.all(batch.token_rewards[0, :6] == 0) and torch.all(batch.advantages == 0)  # the critic's job


def test_gigpo_advantages_in_a_batch_are_episode_plus_step_level():
    rng = np.random.default_rng(1)
    group = multi_turn_group(rng, EPISODES)
    batch = collate([group], "gigpo", gamma=0.5, step_weight=0.7)
    rewards = torch.tensor([1.0, 1.0, 0.0])
    episode = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    steps = gigpo_step_advantages([discounted_returns(r, 0.5) for r, _ in EPISODES], [s for _, s in EPISODES])
    for i, sample in enumerate(group.samples):
        for (a, b), step in zip(turn_spans(sample.loss_mask), steps[i]):
            np.testing.assert_allclose(batch.advantages[i, a:b].numpy(), float(episode[i]) + 0.7 * step, rtol=1e-5)
        n = len(sample.loss_mask)
        assert torch.all(batch.advantages[i, :n][torch.from_numpy(sample.loss_mask) == 0] == 0)
        assert torch.all(batch.advantages[i, n:] == 0)
    # equal episode rewards: no GRPO signal, but discounted, the steps still differ
    same = multi_turn_group(rng, [([0.0, 1.0], ["a", "b"]), ([0.0, 0.0, 1.0], ["a", "c", "b"])])
    assert collate([same], "grpo").group_signal.tolist() == [False]
    assert collate([same], "gigpo", gamma=0.5).group_signal.tolist() == [True]  # a: 0.5 against 0.25


def test_gigpo_takes_a_group_without_signal_whose_turn_states_are_unknown():
    """Issue 26: a group of equal rewards with a sample whose turn states are unknown (no step
    advantages: None) raised TypeError in collate, the learner died and the group came back
    until the run stopped. Its steps count as no signal; a known sample's still do."""
    rng = np.random.default_rng(3)
    flat = multi_turn_group(rng, [([0.0, 1.0], ["a", "b"]), ([0.0, 1.0], ["a", "b"])])
    flat.samples[1].turn_states = []  # unknown
    batch = collate([flat], "gigpo", gamma=0.5)
    assert batch.group_signal.tolist() == [False]  # equal rewards, the known sample alone: nothing to compare
    assert torch.all(batch.loss_mask == 0) and torch.all(batch.advantages == 0)
    differs = multi_turn_group(rng, [([0.0, 1.0], ["a", "b"]), ([0.0, 0.0, 1.0], ["a", "c", "b"]),
                                     ([0.0, 1.0], ["a", "b"])])
    differs.samples[2].turn_states = []
    assert collate([differs], "gigpo", gamma=0.5).group_signal.tolist() == [True]  # the known two differ


def test_turn_states_travel_in_the_message():
    rng = np.random.default_rng(2)
    group = multi_turn_group(rng, EPISODES)
    assert [s.turn_states for s in decode_group(encode_group(group)).samples] == [s for _, s in EPISODES]
    group.samples[0].turn_states = ["a"]  # not one per turn
    from common.messages import CodecError
    with pytest.raises(CodecError, match="turn_states"):
        decode_group(encode_group(group))


def trainer_for(tiny_model, **learner):
    from learner.trainer import Trainer
    torch.manual_seed(0)
    return Trainer(load_causal_lm(tiny_model), LearnerConfig(**learner))


@pytest.mark.parametrize("targets", ["gae", "auto"])
def test_ppo_value_loss_falls_and_the_head_is_checkpointed_not_published(tiny_model, targets, tmp_path):
    rng = np.random.default_rng(3)
    trainer = trainer_for(tiny_model, algorithm="ppo", critic_targets=targets, critic_lr=1e-2, gamma=0.9, gae_lambda=0.95)
    groups = [multi_turn_group(rng, EPISODES, version=0) for _ in range(2)]
    steps = [trainer.train_step(collate(groups, "ppo", version=1)) for _ in range(8)]  # version 1: the samples are stale
    losses = [m["learner/loss/value"] for m in steps]
    assert steps[0]["learner/vtrace_frac"] == (1.0 if targets == "auto" else 0.0)  # auto: V-trace on stale samples
    assert max(losses[-2:]) < 0.5 * losses[0], losses
    state = trainer.parallel.train_state(trainer.scorer, trainer.optimizer)["model"]
    assert {"value_head.weight", "value_head.bias"} <= set(state)
    assert not any("value_head" in k for k in trainer.hf_state())
    path = begin(tmp_path, 8)
    trainer.save_checkpoint(path, background=False).result()
    other = trainer_for(tiny_model, algorithm="ppo")
    other.load_checkpoint(path)
    torch.testing.assert_close(other.scorer.value_head.weight, trainer.scorer.value_head.weight)


def test_naive_loss_clips_against_the_behaviour_policy(tiny_model):
    rng = np.random.default_rng(4)
    groups = [varied_group(rng) for _ in range(2)]  # behaviour log-probs far from the tiny model's
    naive = trainer_for(tiny_model, loss="naive").train_step(collate(groups))
    decoupled = trainer_for(tiny_model).train_step(collate(groups))
    assert decoupled["learner/frac_clipped"] == 0 and decoupled["learner/ratio_mean"] == pytest.approx(1.0)
    # the ratio is exp(lc - lb): clipped wherever it is outside [0.8, 1.2] on the side the advantage's sign picks
    assert naive["learner/frac_clipped"] > 0.2 and naive["learner/frac_rejected"] == 0 and naive["learner/mismatch_kl"] == 0


def test_kl_to_the_reference_starts_at_zero_and_grows(tiny_model):
    rng = np.random.default_rng(5)
    trainer = trainer_for(tiny_model, kl_coef=0.1, lr=3e-3)
    batch = lambda: collate([varied_group(rng) for _ in range(2)])  # noqa: E731
    kls = [trainer.train_step(batch())["learner/kl_ref"] for _ in range(4)]
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 1e-4, kls


def test_drgrpo_divides_the_token_sum_by_a_constant(tiny_model):
    rng = np.random.default_rng(6)
    groups = [varied_group(rng) for _ in range(2)]
    tokens = collate(groups).num_trained_tokens
    samples = sum(len(g.samples) for g in groups)
    one = trainer_for(tiny_model, algorithm="drgrpo", token_sum_norm=10).train_step(collate(groups, "drgrpo"))
    two = trainer_for(tiny_model, algorithm="drgrpo", token_sum_norm=20).train_step(collate(groups, "drgrpo"))
    assert one["learner/loss/policy"] == pytest.approx(2 * two["learner/loss/policy"], rel=1e-5)
    mean = trainer_for(tiny_model, algorithm="drgrpo").train_step(collate(groups, "drgrpo"))  # unset: token mean
    assert one["learner/loss/policy"] == pytest.approx(mean["learner/loss/policy"] * tokens / (samples * 10), rel=1e-5)
    cfg = Config.model_validate({"learner": {"algorithm": "drgrpo"}, "actor": {"max_tokens": 7, "max_turns": 3}})
    assert cfg.learner.token_sum_norm == 21
