"""Batch assembly: rollout groups -> padded tensors with per-sample advantages."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from common.messages import RolloutGroup
from learner.algorithms import grpo_advantages, has_signal


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor  # (N, T) long, right-padded
    attention_mask: torch.Tensor  # (N, T)
    loss_mask: torch.Tensor  # (N, T) float, 1 on generated tokens of groups with signal
    generated_mask: torch.Tensor  # (N, T) float, 1 on every generated token
    behav_logprobs: torch.Tensor  # (N, T)
    advantages: torch.Tensor  # (N,)
    rewards: np.ndarray  # (N,)
    group_signal: np.ndarray  # (n_groups,) bool
    num_groups: int

    @property
    def num_trained_tokens(self) -> int:
        return int(self.loss_mask.sum())


def collate(groups: list[RolloutGroup], scale_by_std: bool = True, pad_id: int = 0) -> Batch:
    samples = [s for g in groups for s in g.samples]
    T = max(len(s.tokens) for s in samples)
    N = len(samples)
    tokens = torch.full((N, T), pad_id, dtype=torch.long)
    attention = torch.zeros((N, T), dtype=torch.long)
    loss_mask = torch.zeros((N, T), dtype=torch.float32)
    generated = torch.zeros((N, T), dtype=torch.float32)
    behav = torch.zeros((N, T), dtype=torch.float32)
    advantages, signal = [], []
    for g in groups:
        rewards = torch.from_numpy(g.rewards).unsqueeze(0)  # (1, G)
        signal.append(bool(has_signal(rewards)[0]))
        advantages.append(grpo_advantages(rewards, scale_by_std)[0] if signal[-1] else torch.zeros(len(g.samples)))
    sample_signal = [sig for g, sig in zip(groups, signal) for _ in g.samples]
    for i, (s, sig) in enumerate(zip(samples, sample_signal)):
        n = len(s.tokens)
        tokens[i, :n] = torch.from_numpy(s.tokens.astype(np.int64))
        attention[i, :n] = 1
        generated[i, :n] = torch.from_numpy(s.loss_mask.astype(np.float32))
        if sig:
            loss_mask[i, :n] = generated[i, :n]
        behav[i, :n] = torch.from_numpy(s.logprobs.copy())
    return Batch(tokens, attention, loss_mask, generated, behav, torch.cat(advantages).float(),
                 np.array([s.reward for s in samples], np.float32), np.array(signal), len(groups))
