"""Batch assembly: rollout groups -> padded tensors with per-sample advantages, and the plan
that splits a batch into minibatches (one optimizer step each), ranks and micro-batches
(one forward each, at most `max_tokens` padded tokens)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from common.messages import RolloutGroup
from learner.algorithms import advantages as estimate


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor  # (N, T) long, right-padded
    attention_mask: torch.Tensor  # (N, T)
    loss_mask: torch.Tensor  # (N, T) float, 1 on generated tokens of groups with signal
    generated_mask: torch.Tensor  # (N, T) float, 1 on every generated token
    behav_logprobs: torch.Tensor  # (N, T)
    advantages: torch.Tensor  # (N,)
    temperature: torch.Tensor  # (N,) the temperature each sample was drawn at
    rewards: np.ndarray  # (N,)
    group_signal: np.ndarray  # (n_groups,) bool
    num_groups: int
    prox_logprobs: torch.Tensor | None = None  # (N, T), filled by the trainer when it needs them

    @property
    def num_trained_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def lengths(self) -> np.ndarray:
        return self.attention_mask.sum(1).numpy()

    def micro(self, idx: list[int], device: torch.device) -> MicroBatch:
        """Samples `idx`, cut to their longest, as the rows the scorer needs, on `device`."""
        T = int(self.lengths[idx].max())
        sel = torch.tensor(idx)
        gen = self.generated_mask[sel, :T]
        rows = gen.nonzero()  # (M, 2): (sample in the micro-batch, t), generated tokens only
        at = (sel[rows[:, 0]], rows[:, 1])
        prox = self.prox_logprobs[at] if self.prox_logprobs is not None else None
        to = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(tokens=to(self.tokens[sel, :T]), attention_mask=to(self.attention_mask[sel, :T]),
                          rows=to(rows), temperature=to(self.temperature[at[0]]), loss_mask=to(self.loss_mask[at]),
                          behav_logprobs=to(self.behav_logprobs[at]), advantages=to(self.advantages[at[0]]),
                          prox_logprobs=to(prox), cpu_rows=at)


@dataclasses.dataclass
class MicroBatch:
    """One forward's worth: padded (n, t) inputs and, per scored row, (M,) vectors."""

    tokens: torch.Tensor  # (n, t)
    attention_mask: torch.Tensor  # (n, t)
    rows: torch.Tensor  # (M, 2) (sample, position) of each generated token
    temperature: torch.Tensor  # (M,)
    loss_mask: torch.Tensor  # (M,) 1 where the token is trained on
    behav_logprobs: torch.Tensor  # (M,)
    advantages: torch.Tensor  # (M,)
    prox_logprobs: torch.Tensor | None  # (M,)
    cpu_rows: tuple[torch.Tensor, torch.Tensor]  # the rows as indices into the Batch's (N, T) tensors


def collate(groups: list[RolloutGroup], algorithm: str = "grpo", pad_id: int = 0) -> Batch:
    """Padded tensors of the groups' samples, with each sample's advantage by `algorithm`
    (learner.algorithm); samples of groups without signal get loss mask 0."""
    samples = [s for g in groups for s in g.samples]
    T = max(len(s.tokens) for s in samples)
    N = len(samples)
    tokens = torch.full((N, T), pad_id, dtype=torch.long)
    attention = torch.zeros((N, T), dtype=torch.long)
    loss_mask = torch.zeros((N, T), dtype=torch.float32)
    generated = torch.zeros((N, T), dtype=torch.float32)
    behav = torch.zeros((N, T), dtype=torch.float32)
    advantages, signal = estimate(algorithm, [torch.from_numpy(g.rewards) for g in groups])
    sample_signal = [sig for g, sig in zip(groups, signal) for _ in g.samples]
    for i, (s, sig) in enumerate(zip(samples, sample_signal)):
        n = len(s.tokens)
        tokens[i, :n] = torch.from_numpy(s.tokens.astype(np.int64))
        attention[i, :n] = 1
        generated[i, :n] = torch.from_numpy(s.loss_mask.astype(np.float32))
        if sig:
            loss_mask[i, :n] = generated[i, :n]
        behav[i, :n] = torch.from_numpy(s.logprobs.copy())
    generated[:, 0] = 0  # the first token has no prediction: always context
    loss_mask[:, 0] = 0
    # Greedy decoding (0) is scored as temperature 1: its log-probs are those of the raw logits.
    temperature = torch.tensor([float(g.sampling.get("temperature", 1.0)) or 1.0
                                for g in groups for _ in g.samples], dtype=torch.float32)
    return Batch(tokens, attention, loss_mask, generated, behav, torch.cat(advantages).float(), temperature,
                 np.array([s.reward for s in samples], np.float32), np.array(signal), len(groups))


def split_by_tokens(idx: list[int], lengths: np.ndarray, parts: int) -> list[list[int]]:
    """`idx` into `parts` lists of nearly equal token counts (longest first, each to the lightest part)."""
    out: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(idx, key=lambda i: -int(lengths[i])):
        k = load.index(min(load))
        out[k].append(i)
        load[k] += int(lengths[i])
    return [sorted(p) for p in out]


def microbatches(idx: list[int], lengths: np.ndarray, max_tokens: int) -> list[list[int]]:
    """`idx` sorted by length and cut so that each micro-batch, padded to its longest, holds at most
    `max_tokens` tokens (a sample longer than that goes alone)."""
    out: list[list[int]] = []
    for i in sorted(idx, key=lambda i: -int(lengths[i])):
        if out and (len(out[-1]) + 1) * int(lengths[out[-1][0]]) <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


@dataclasses.dataclass
class Plan:
    """minibatches[k][rank] = that rank's micro-batches (lists of sample indices) of minibatch k,
    every rank with the same count (an empty list is a rank's idle pass)."""

    minibatches: list[list[list[list[int]]]]
    padding_frac: float


def plan(batch: Batch, minibatches: int, ranks: int, max_tokens: int) -> Plan:
    lengths = batch.lengths
    padded = real = 0
    out = []
    for mb in split_by_tokens(list(range(len(lengths))), lengths, minibatches):
        if not mb:  # more minibatches than samples: no optimizer step on nothing (AdamW's momentum would move)
            continue
        per_rank = [microbatches(share, lengths, max_tokens) for share in split_by_tokens(mb, lengths, ranks)]
        passes = max(1, max(len(m) for m in per_rank))  # every rank runs as many forwards as the busiest
        out.append([m + [[]] * (passes - len(m)) for m in per_rank])
        for m in per_rank:
            for micro in m:
                padded += len(micro) * int(lengths[micro].max())
                real += int(lengths[micro].sum())
    return Plan(out, 1 - real / max(padded, 1))
