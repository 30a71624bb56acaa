"""The trainer on the tiny model: a finite step moves the weights; a non-finite loss or
gradient skips the optimizer step, counted, and leaves the weights as they were."""

import numpy as np
import pytest
import torch

from common.config import LearnerConfig
from common.models import load_causal_lm
from learner.batch import collate
from tests.integration.test_learner_faults import synthetic_group


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("poison", ["advantage", "behaviour_logprob"])
def test_non_finite_loss_skips_the_step(tiny_model, poison):
    from learner.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(load_causal_lm(tiny_model), LearnerConfig())
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
