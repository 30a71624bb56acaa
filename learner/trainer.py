"""One optimizer step on a batch: proximal log-probs, the off-policy loss, AdamW."""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch
from safetensors.torch import save as save_safetensors

from common.config import LearnerConfig
from common.timing import Timer
from learner.algorithms import LossConfig, masked_mean, policy_loss, token_entropy, token_logprobs
from learner.batch import Batch

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig):
        self.model, self.cfg = model, cfg
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.loss_cfg = LossConfig(cfg.clip_eps_low, cfg.clip_eps_high, cfg.behav_weight_cap, cfg.behav_reject,
                                   cfg.dual_clip)
        self.timer = Timer()
        self.skipped_nonfinite = 0  # optimizer steps skipped for a non-finite loss or gradient

    def _logits(self, batch: Batch) -> torch.Tensor:
        return self.model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits  # (N, T, V)

    def train_step(self, batch: Batch) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if batch.num_trained_tokens == 0 and self.cfg.entropy_coef == 0:
            metrics.update({"learner/skipped": 1.0})
            return metrics
        self.model.train()
        with self.timer("proximal"), torch.no_grad():
            prox = token_logprobs(self._logits(batch), batch.tokens)  # (N, T)
        with self.timer("forward"):
            logits = self._logits(batch)
            cur, entropy = token_logprobs(logits, batch.tokens), token_entropy(logits)  # (N, T) each
            pg_loss, loss_metrics = policy_loss(cur, prox, batch.behav_logprobs, batch.advantages, batch.loss_mask,
                                                self.loss_cfg)
            # Over every generated token, groups without signal included: that is where a
            # collapsed (deterministic) policy needs the push back towards exploring.
            mean_entropy = masked_mean(entropy, batch.generated_mask)
            loss = pg_loss - self.cfg.entropy_coef * mean_entropy
        with self.timer("backward"):
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        # Bad numbers never reach the weights: a non-finite loss or gradient skips the update.
        finite = bool(torch.isfinite(loss.detach()) and torch.isfinite(grad_norm))
        if finite:
            with self.timer("optimizer"):
                self.optimizer.step()
        else:
            self.skipped_nonfinite += 1
            log.warning("non-finite loss (%s) or gradient norm (%s): optimizer step skipped (%d so far)",
                        float(loss.detach()), float(grad_norm), self.skipped_nonfinite)
        # Freed now, not before the next backward: kept, they would sit through the next step's
        # forward passes (`omrl bench learner` measured 4% more peak memory on a 100M model).
        self.optimizer.zero_grad(set_to_none=True)
        metrics["learner/skipped_nonfinite"] = float(self.skipped_nonfinite)
        metrics["learner/loss/policy"] = float(pg_loss.detach())
        metrics["learner/entropy"] = float(mean_entropy.detach())
        metrics["learner/grad_norm"] = float(grad_norm)
        metrics.update({f"learner/{k}": v for k, v in loss_metrics.items()})
        metrics.update(self.timer.pop("learner/time/"))
        return metrics

    def weights_blob(self) -> bytes:
        """The weights as safetensors bytes, named as in the Hugging Face checkpoint."""
        state = {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}
        return save_safetensors(state)


def learn(trainer: Trainer, batches: Iterable[Batch]) -> Iterator[dict[str, float]]:
    """Train on each batch in turn; a test passes a list, the worker a broker-fed iterator."""
    for batch in batches:
        yield trainer.train_step(batch)
