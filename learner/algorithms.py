"""Advantages and the off-policy-corrected policy loss: pure torch, no I/O.

Shapes: N samples, T tokens. `loss_mask` is 1 on generated tokens.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import torch

EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Estimator:
    """An advantage estimator: rewards (n_groups, G) -> advantages (n_groups, G). Group-relative
    ones give a group whose rewards are all equal no signal (its samples are not trained on)."""

    advantages: Callable[[torch.Tensor], torch.Tensor]
    group_relative: bool = True


ESTIMATORS: dict[str, Estimator] = {}


def estimator(name: str, group_relative: bool = True):
    """Register an advantage estimator under `learner.algorithm = name`."""
    def register(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ESTIMATORS[name] = Estimator(fn, group_relative)
        return fn
    return register


@estimator("grpo")
def grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(R - mean_g R) / (std_g R + 1e-6), std the unbiased sample std (GRPO)."""
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    return centered / (rewards.std(dim=1, keepdim=True) + EPS)


@estimator("drgrpo")
def drgrpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """R - mean_g R: GRPO without the division by the std (Dr.GRPO)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


@estimator("rloo")
def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """R_i - mean_{j != i} R_j: each sample's baseline is the mean of the group's others
    (REINFORCE leave-one-out, Ahmadian et al. 2024); equals G / (G - 1) x (R - mean_g R)."""
    G = rewards.shape[1]
    return (rewards * G - rewards.sum(dim=1, keepdim=True)) / (G - 1)


@estimator("reinforce", group_relative=False)
def reinforce_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """R - mean R over the whole batch: REINFORCE with the batch's mean reward as baseline (no
    grouping: a group whose rewards are all equal still learns from the others)."""
    return rewards - rewards.mean()


def advantages(algorithm: str, rewards: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[bool]]:
    """Each group's rewards (G,) -> its samples' advantages, and whether the group carries signal.
    Group-relative estimators see one group at a time (groups may differ in size); the others
    see the whole batch as one row."""
    try:
        est = ESTIMATORS[algorithm]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {algorithm!r}: choose one of {sorted(ESTIMATORS)} "
                         f"(learner.algorithm)") from None
    if not est.group_relative:
        flat = est.advantages(torch.cat(rewards).unsqueeze(0))[0]
        return list(flat.split([len(r) for r in rewards])), [True] * len(rewards)
    signal = [bool(has_signal(r.unsqueeze(0))[0]) for r in rewards]
    return [est.advantages(r.unsqueeze(0))[0] if sig else torch.zeros_like(r) for r, sig in zip(rewards, signal)], signal


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over each row's masked positions.

    rewards, values, mask (N, T): the steps of a row are its positions with mask 1, in order
    (the context between an agent's turns is skipped); the value after a row's last step is 0.
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}; returns A and the
    value targets A + V, both 0 off the mask."""
    N, T = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(N, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in range(T - 1, -1, -1):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, 0.0)
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
    return adv, (adv + values) * (mask > 0)


def vtrace(rewards: torch.Tensor, values: torch.Tensor, log_rhos: torch.Tensor, mask: torch.Tensor, gamma: float,
           lam: float = 1.0, rho_bar: float = 1.0, c_bar: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets (Espeholt et al. 2018, IMPALA) for data a behaviour policy mu sampled.

    log_rhos (N, T): log pi/mu per step; steps as in `gae`. rho_t = min(rho_bar, pi/mu),
    c_t = lam min(c_bar, pi/mu); v_t - V_t = rho_t delta_t + gamma c_t (v_{t+1} - V_{t+1}) with
    delta_t = r_t + gamma V_{t+1} - V_t. Returns the policy-gradient advantage q_t - V_t, with
    q_t = r_t + gamma v_{t+1}, and the value targets v_t. IMPALA multiplies the advantage by
    rho_t; the loss applies its own behaviour weight (or ratio, naive), so it is left out here."""
    N, T = rewards.shape
    ratio = torch.exp(log_rhos)
    vs = torch.zeros_like(values)
    adv = torch.zeros_like(values)
    zeros = torch.zeros(N, dtype=values.dtype, device=values.device)
    next_value, next_vs, next_acc = zeros, zeros, zeros
    for t in range(T - 1, -1, -1):
        m = mask[:, t] > 0
        rho, c = ratio[:, t].clamp(max=rho_bar), lam * ratio[:, t].clamp(max=c_bar)
        acc = rho * (rewards[:, t] + gamma * next_value - values[:, t]) + gamma * c * next_acc
        v_t = values[:, t] + acc
        adv[:, t] = torch.where(m, rewards[:, t] + gamma * next_vs - values[:, t], 0.0)
        vs[:, t] = torch.where(m, v_t, 0.0)
        next_acc = torch.where(m, acc, next_acc)
        next_vs = torch.where(m, v_t, next_vs)
        next_value = torch.where(m, values[:, t], next_value)
    return adv, vs


def gigpo_step_advantages(turn_returns: list[list[float]], turn_states: list[list[str]],
                          scale_by_std: bool = True) -> list[list[float]]:
    """GiGPO's step-level advantages (Feng et al. 2025, verl-agent) for one group's episodes.

    turn_returns[i][k]: the discounted return of episode i from turn k on; turn_states[i][k]: the
    env's key of the state turn k acted in. Turns of the group that acted in the same state form an
    anchor group; a turn's advantage is its return against its anchor group's: (G - mean) / (std +
    eps), std the unbiased one (0 for an anchor group of one turn, or of equal returns)."""
    anchors: dict[str, list[float]] = {}
    for returns, states in zip(turn_returns, turn_states):
        for g, key in zip(returns, states):
            anchors.setdefault(key, []).append(g)

    def advantage(g: float, key: str) -> float:
        others = anchors[key]
        centered = g - statistics.fmean(others)
        if not scale_by_std:
            return centered
        return centered / ((statistics.stdev(others) if len(others) > 1 else 0.0) + EPS)

    return [[advantage(g, key) for g, key in zip(returns, states)]
            for returns, states in zip(turn_returns, turn_states)]


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """G_k = r_k + gamma G_{k+1} for one episode's turn rewards."""
    out, g = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        g = rewards[k] + gamma * g
        out[k] = g
    return out


def kl_penalty(cur_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens pi sampled (Schulman's k1 and k3):
    k1 = log pi - log pi_ref (unbiased, may be negative); k3 = exp(-k1) - 1 + k1 (unbiased under pi
    sampling, never negative, lower variance)."""
    log_ratio = cur_logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}: choose k1 or k3 (learner.kl_estimator)")


def refused_unlikelihood(logprobs: torch.Tensor, turn_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per refused turn, the unlikelihood -log(1 - P) of its action and P, the policy's probability
    of the whole action (the product of its tokens'). logprobs (M,), turn_ids (M,): each token's
    refused turn (0: none). Its gradient does not vanish where the policy is sure of the action:
    a policy gradient's on a token of probability p is (1 - p) in its logit, this term's P (1 - p)
    / (1 - P), at most 1, so an action the policy repeats at P = 0.99 still gets pushed down."""
    on = turn_ids > 0
    if not bool(on.any()):
        empty = logprobs.new_zeros(0)
        return empty, empty
    _, turn = torch.unique(turn_ids[on], return_inverse=True)
    seq = logprobs.new_zeros(int(turn.max()) + 1, dtype=torch.float32).index_add(0, turn, logprobs[on].float())
    # log(1 - P) = log(-expm1(log P)), exact near P = 1; P within 1e-6 of 1 is beyond fp32's log-probs
    return -torch.log(-torch.expm1(seq.clamp(max=-1e-6))), seq.exp()


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


def behaviour_weight(num_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, m: torch.Tensor, cfg: LossConfig
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The importance weight of the behaviour policy's tokens under `num_logprobs`' policy, no
    gradient: w = min(exp(num - lb), C), and tokens whose exp(num - lb) is above `behav_reject`
    masked out. Returns (w, kept mask, truncated, rejected)."""
    ratio = torch.exp(num_logprobs - behav_logprobs).detach()
    rejected = (ratio > cfg.behav_reject) & (m > 0)
    truncated = (ratio > cfg.behav_weight_cap) & (m > 0) & ~rejected
    return ratio.clamp(max=cfg.behav_weight_cap), m * (~rejected).float(), truncated, rejected


def _loss_stats(m, kept, weight, truncated, rejected, log_ratio, clipped, ratio) -> dict[str, torch.Tensor]:
    """Sums over the tokens of one loss call (`loss_metrics` turns summed sums into metrics);
    log_ratio: log(behaviour weight's numerator / behaviour) on the trained tokens."""
    w_kept = weight * kept
    return {
        "tokens": m.sum(), "kept": kept.sum(), "w": w_kept.sum(), "w2": (w_kept ** 2).sum(),
        # k3 estimator of KL(behaviour || the weight's numerator), always >= 0.
        "kl": ((torch.exp(log_ratio) - log_ratio - 1) * m).sum(),
        "truncated": truncated.float().sum(), "rejected": rejected.float().sum(),
        "clipped": (clipped & (kept > 0)).float().sum(), "ratio": (ratio * kept).sum(),
    }


def _expand(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return advantages if advantages.shape == like.shape else advantages.unsqueeze(1).expand_as(like)


def policy_loss(cur_logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
                advantages: torch.Tensor, loss_mask: torch.Tensor, cfg: LossConfig,
                norm_tokens: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO with a capped behaviour weight (docs/concepts/loss.md, the default loss).

    cur/prox/behav_logprobs, loss_mask: any shape S; advantages: S, or (N,) for S = (N, T).
    w = min(exp(lp - lb), C) (no grad), tokens with exp(lp - lb) > reject get weight 0;
    r = exp(lc - lp); loss = -(1/n) sum m w min(r A, clip(r, 1-eps_low, 1+eps_high) A), with n
    the trained tokens (`norm_tokens`, default sum m) counted before rejection, as AReaL does: it
    is known before the forward, so micro-batches and ranks sum to the loss of the whole batch.
    Naive PPO is this loss with the behaviour log-probs as the proximal ones (w = 1).
    Returns the loss and sums over these tokens (`loss_metrics` turns summed sums into metrics).
    """
    advantages = _expand(advantages, cur_logprobs)
    m = loss_mask.float()
    weight, kept, truncated, rejected = behaviour_weight(prox_logprobs, behav_logprobs, m, cfg)

    ratio = torch.exp(cur_logprobs - prox_logprobs.detach())
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * advantages
    objective = torch.minimum(unclipped, clipped)
    if cfg.dual_clip is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, cfg.dual_clip * advantages), objective)
    denom = norm_tokens if norm_tokens is not None else m.sum().clamp(min=1.0)
    loss = -(kept * weight * objective).sum() / denom
    with torch.no_grad():
        stats = _loss_stats(m, kept, weight, truncated, rejected, (prox_logprobs - behav_logprobs) * m,
                            unclipped != objective, ratio)
    return loss, stats


def tis_loss(cur_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, advantages: torch.Tensor,
             loss_mask: torch.Tensor, cfg: LossConfig, norm_tokens: float | torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance-sampled policy gradient (learner.loss = "tis": PipelineRL's loss,
    verl's rollout correction with the token-level cap): w = min(exp(lc - lb), C) with no
    gradient, tokens whose exp(lc - lb) is above `behav_reject` masked out (masked IS), and
    loss = -(1/n) sum m w lc A, n as `policy_loss`'s. No proximal policy and no clip: the cap is
    its whole trust region, and a token past it keeps its gradient, scaled to C, where PPO's clip
    drops it. Stats as `policy_loss`'s (`clipped` counts the truncated tokens)."""
    advantages = _expand(advantages, cur_logprobs)
    m = loss_mask.float()
    weight, kept, truncated, rejected = behaviour_weight(cur_logprobs, behav_logprobs, m, cfg)
    denom = norm_tokens if norm_tokens is not None else m.sum().clamp(min=1.0)
    loss = -(kept * weight * cur_logprobs * advantages).sum() / denom
    with torch.no_grad():
        stats = _loss_stats(m, kept, weight, truncated, rejected, (cur_logprobs - behav_logprobs) * m, truncated,
                            weight)
    return loss, stats


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor,
               clip: float | None) -> torch.Tensor:
    """PPO's clipped value loss, summed over the mask: 0.5 max((V - R)^2, (V_clip - R)^2) with
    V_clip = V_old + clip(V - V_old, -clip, clip) (0.5 (V - R)^2 when `clip` is None)."""
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * (loss * mask).sum()


def add_stats(total: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: total.get(k, 0.0) + stats.get(k, 0.0) for k in {**total, **stats}}


def loss_metrics(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Summed `policy_loss` stats -> ess, mismatch_kl and fractions of the trained tokens."""
    s = {k: float(v) for k, v in stats.items()}
    n, kept = max(s["tokens"], 1.0), max(s["kept"], 1.0)
    return {
        "ess": s["w"] ** 2 / (s["kept"] * s["w2"]) if s["kept"] and s["w2"] > 0 else 1.0,
        "mismatch_kl": s["kl"] / n,
        "frac_truncated": s["truncated"] / n,
        "frac_rejected": s["rejected"] / n,
        "frac_clipped": s["clipped"] / n,
        "ratio_mean": s["ratio"] / kept,
    }
