"""Supervised fine-tuning on trajectories: the negative log-likelihood of the agent's tokens only
(the loss mask the episode loop builds, the same one RL trains on), scored by the learner's
PolicyScorer and micro-batched as the learner does: each batch is cut into micro-batches of at
most `max_tokens_per_microbatch` padded tokens whose gradients are accumulated, every
micro-batch's loss divided by the batch's trained-token count, so a step equals one forward of
the whole batch. It trains as the RL learner does (learner/trainer.py's `place` and `autocast`):
on learner.device, fp32 master weights and AdamW state, learner.precision's compute (bf16
autocast), learner.gradient_checkpointing, the output layer in learner.vocab_chunk columns.
One process: learner.ranks is not used. Pure torch; reading files and evaluating are the
caller's (deploy/sft.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from common.config import LearnerConfig, SFTConfig
from learner.batch import microbatches
from learner.distributed import resolve_device
from learner.scoring import PolicyScorer
from learner.trainer import place, supervised_nll

Example = tuple[Sequence[int], Sequence[int]]  # (tokens, loss_mask) of one episode


def read_examples(paths: Sequence[str], vocab_size: int, positions: int | None = None,
                  field: str = "learner.sft_data") -> list[Example]:
    """(tokens, loss_mask) of every episode of the trajectory files `paths` (parquet, as `omrl collect`
    writes them) as int32 and uint8 arrays, checked against the policy's vocabulary and its
    `positions` (where known): a ValueError names `field` and the fix."""
    import pyarrow.parquet as pq

    examples: list[Example] = []
    fix = "write one with `omrl collect --model MODEL` for the policy's tokenizer"
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"{field}: {path} does not exist: {fix}")
        try:
            table = pq.read_table(path, columns=["tokens", "loss_mask"])
        except (OSError, KeyError, ValueError) as exc:  # not parquet, no such columns
            raise ValueError(f"{field}: {path} is not a trajectory file with tokens and loss masks "
                             f"({' '.join(str(exc).split())}): {fix}") from None
        for n, (tokens, mask) in enumerate(zip(table["tokens"].to_pylist(), table["loss_mask"].to_pylist())):
            if not tokens or mask is None or len(mask) != len(tokens):
                raise ValueError(f"{field}: {path}, record {n} has no tokens and loss mask of one length: write the "
                                 f"file with `omrl collect` or `omrl import-trajectories`")
            bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"{field}: {path}, record {n} has token id {bad}, outside the policy's vocabulary "
                                 f"({vocab_size}): the file was tokenised for another model; write it again with "
                                 f"`omrl collect --model` the policy")
            if positions is not None and len(tokens) > positions:
                raise ValueError(f"{field}: {path}, record {n} has {len(tokens)} tokens, more than the model's "
                                 f"{positions} positions: leave the longer episodes out of the file")
            if any(mask[1:]):
                examples.append((np.asarray(tokens, np.int32), np.asarray(mask, np.uint8)))
    if not examples:
        raise ValueError(f"{field}: no episode with a trained token in {', '.join(paths)}")
    return examples


class SFTTrainer:
    """`learner` says where and how to compute (device, precision, gradient checkpointing,
    vocab_chunk, weight_decay, grad_clip); `sft` what to train (lr, warm-up, micro-batch size)."""

    def __init__(self, model: torch.nn.Module, learner: LearnerConfig, sft: SFTConfig, total_steps: int):
        self.device = resolve_device(learner.device, 0)
        self.precision = learner.precision
        self.scorer = PolicyScorer(place(model, learner, self.device), learner.vocab_chunk).to(self.device)
        self.optimizer = torch.optim.AdamW(self.scorer.parameters(), lr=sft.lr, weight_decay=learner.weight_decay)
        # Linear warm-up, then cosine decay to a tenth of `lr` at `total_steps`.
        warmup = sft.warmup
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(
            (s + 1) / max(1, warmup), 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / max(1, total_steps))))))
        self.grad_clip, self.max_tokens = learner.grad_clip, sft.max_tokens_per_microbatch

    def step(self, examples: Sequence[Example]) -> dict[str, float]:
        """One optimizer step on `examples`; the mean NLL per trained token and the step's figures."""
        self.scorer.train()
        lengths = np.array([len(t) for t, _m in examples])
        n_train = sum(int(sum(m)) for _t, m in examples)
        if n_train == 0:
            raise ValueError("no trained token in the batch: every loss mask is 0")
        total = 0.0
        for idx in microbatches(list(range(len(examples))), lengths, self.max_tokens):
            loss = self._nll([examples[i] for i in idx]) / n_train
            loss.backward()
            total += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.scorer.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        return {"sft/loss": total, "sft/trained_tokens": float(n_train), "sft/grad_norm": float(grad_norm),
                "sft/lr": self.schedule.get_last_lr()[0]}

    @torch.no_grad()
    def evaluate(self, examples: Sequence[Example]) -> float:
        """The mean NLL per trained token of `examples` (held-out trajectories)."""
        self.scorer.eval()
        lengths = np.array([len(t) for t, _m in examples])
        total, n = 0.0, 0
        for idx in microbatches(list(range(len(examples))), lengths, self.max_tokens):
            part = [examples[i] for i in idx]
            total += float(self._nll(part))
            n += sum(int(sum(m)) for _t, m in part)
        return total / max(1, n)

    def _nll(self, examples: Sequence[Example]) -> torch.Tensor:
        """The summed negative log-likelihood of the trained tokens of `examples`, padded together."""
        return supervised_nll(self.scorer, list(examples), self.device, self.precision)[0]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The causal LM's weights, named as in Hugging Face (what `save_pretrained` and vLLM take)."""
        return {k: v.detach().cpu() for k, v in self.scorer.lm.state_dict().items()}
