"""Advantages and the off-policy-corrected policy loss: pure torch, no I/O.

Shapes: N samples, T tokens. `loss_mask` is 1 on generated tokens.
"""

from __future__ import annotations

import dataclasses

import torch

EPS = 1e-6


def grpo_advantages(rewards: torch.Tensor, scale_by_std: bool = True) -> torch.Tensor:
    """rewards (n_groups, G) -> advantages (n_groups, G): (R - mean_g R) / (std_g R + 1e-6).
    Dr.GRPO leaves out the division by the std. std is the unbiased sample std."""
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True) + EPS)


def has_signal(rewards: torch.Tensor) -> torch.Tensor:
    """rewards (n_groups, G) -> (n_groups,) bool: False where every reward of the group is equal."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0


@dataclasses.dataclass(frozen=True)
class LossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    behav_weight_cap: float = 2.0
    behav_reject: float = 5.0
    dual_clip: float | None = None
    token_sum: bool = False
    """Dr.GRPO: normalise by a constant token count instead of the mask sum."""


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits (N, T, V), tokens (N, T) -> (N, T) log-prob of tokens[:, t] given tokens[:, :t];
    position 0 has no prediction and gets 0 (it is always context)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (N, T-1, V)
    picked = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)  # (N, T-1)
    return torch.nn.functional.pad(picked, (1, 0))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """logits (N, T, V) -> (N, T) entropy of the distribution that produced tokens[:, t]
    (from logits[:, t - 1]); position 0 gets 0, like token_logprobs."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (N, T-1, V)
    entropy = -(logp.exp() * logp).sum(-1)  # (N, T-1)
    return torch.nn.functional.pad(entropy, (1, 0))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(cur_logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
                advantages: torch.Tensor, loss_mask: torch.Tensor, cfg: LossConfig,
                norm_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO with a capped behaviour weight (ARCHITECTURE.md, default loss).

    cur/prox/behav_logprobs, loss_mask: (N, T); advantages: (N,) or (N, T).
    w = min(exp(lp - lb), C) (no grad), tokens with exp(lp - lb) > reject masked out;
    r = exp(lc - lp); loss = -(1/sum m) sum m w min(r A, clip(r, 1-eps_low, 1+eps_high) A).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(cur_logprobs)
    mask = loss_mask.float()
    behav_ratio = torch.exp(prox_logprobs - behav_logprobs).detach()
    rejected = (behav_ratio > cfg.behav_reject) & (mask > 0)
    truncated = (behav_ratio > cfg.behav_weight_cap) & (mask > 0) & ~rejected
    mask = mask * (~rejected).float()
    weight = behav_ratio.clamp(max=cfg.behav_weight_cap)

    ratio = torch.exp(cur_logprobs - prox_logprobs.detach())
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * advantages
    objective = torch.minimum(unclipped, clipped)
    if cfg.dual_clip is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, cfg.dual_clip * advantages), objective)
    denom = norm_tokens if norm_tokens is not None else mask.sum().clamp(min=1.0)
    loss = -(mask * weight * objective).sum() / denom

    with torch.no_grad():
        m = loss_mask.float()
        n = m.sum().clamp(min=1.0)
        w_kept = weight[mask > 0]
        log_ratio = (prox_logprobs - behav_logprobs)[m > 0]
        metrics = {
            "ess": float(w_kept.sum() ** 2 / (w_kept.numel() * (w_kept ** 2).sum()).clamp(min=EPS)) if w_kept.numel() else 1.0,
            # k3 estimator of KL(behaviour || proximal), always >= 0.
            "mismatch_kl": float((torch.exp(log_ratio) - log_ratio - 1).mean()) if log_ratio.numel() else 0.0,
            "frac_truncated": float(truncated.float().sum() / n),
            "frac_rejected": float(rejected.float().sum() / n),
            "frac_clipped": float(((unclipped != objective) & (mask > 0)).float().sum() / n),
            "ratio_mean": float((ratio * mask).sum() / mask.sum().clamp(min=1.0)),
        }
    return loss, metrics
