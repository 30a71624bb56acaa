"""Batch assembly: rollout groups -> padded tensors with per-sample advantages, and the plan
that splits a batch into minibatches (one optimizer step each), ranks and micro-batches
(one forward each, at most `max_tokens` padded tokens)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from common.config import CRITIC_ALGORITHMS
from common.messages import RolloutGroup, Sample
from learner.algorithms import advantages as estimate
from learner.algorithms import discounted_returns, gigpo_step_advantages


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor  # (N, T) long, right-padded
    attention_mask: torch.Tensor  # (N, T)
    loss_mask: torch.Tensor  # (N, T) float, 1 on generated tokens of groups with signal
    generated_mask: torch.Tensor  # (N, T) float, 1 on every generated token
    behav_logprobs: torch.Tensor  # (N, T)
    advantages: torch.Tensor  # (N, T) per token (0 off the generated tokens); the critic's fill them in training
    token_rewards: torch.Tensor  # (N, T) each turn's reward on its last generated token (the critic's rewards)
    stale: torch.Tensor  # (N,) bool: some token of the sample came from weights older than the learner's
    temperature: torch.Tensor  # (N,) the temperature each sample was drawn at
    rewards: np.ndarray  # (episodes,) each episode's reward once (an agent's segments are samples of one)
    group_signal: np.ndarray  # (n_groups,) bool
    num_groups: int
    refused: torch.Tensor  # (N, T) long: on each refused turn's tokens its id in the batch (from 1), else 0
    prox_logprobs: torch.Tensor | None = None  # (N, T), filled by the trainer when it needs them
    old_values: torch.Tensor | None = None  # (N, T) the critic's values before the update
    returns: torch.Tensor | None = None  # (N, T) the critic's targets
    ref_logprobs: torch.Tensor | None = None  # (N, T) the reference policy's, for the KL penalty
    allowed: Allowed | None = None  # what the actors' mask let through at each token (None: nothing masked)

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
        pick = lambda x: None if x is None else x[at].to(device, non_blocking=True)  # noqa: E731
        to = lambda x: x.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(tokens=to(self.tokens[sel, :T]), attention_mask=to(self.attention_mask[sel, :T]),
                          rows=to(rows), temperature=to(self.temperature[at[0]]), loss_mask=pick(self.loss_mask),
                          behav_logprobs=pick(self.behav_logprobs), advantages=pick(self.advantages),
                          prox_logprobs=pick(self.prox_logprobs), old_values=pick(self.old_values),
                          returns=pick(self.returns), ref_logprobs=pick(self.ref_logprobs), refused=pick(self.refused),
                          cpu_rows=at, allowed=None if self.allowed is None else self.allowed.pairs(at, device))


@dataclasses.dataclass
class Allowed:
    """Sample.allowed_counts and Sample.allowed of a batch: at each token (N, T) how many tokens
    the mask let through (0: not masked) and where its ids begin in `ids`, the batch's ids."""

    counts: torch.Tensor  # (N, T) long
    starts: torch.Tensor  # (N, T) long
    ids: torch.Tensor  # (P,) long

    @staticmethod
    def of(samples: list[Sample], T: int) -> Allowed | None:
        if all(s.allowed is None for s in samples):
            return None
        counts = torch.zeros((len(samples), T), dtype=torch.long)
        for i, s in enumerate(samples):
            if s.allowed is not None:
                counts[i, :len(s.tokens)] = torch.from_numpy(s.allowed_counts.astype(np.int64))
        flat = counts.flatten()
        starts = (torch.cumsum(flat, 0) - flat).view_as(counts)  # row-major: sample after sample, as the ids
        ids = torch.from_numpy(np.concatenate([s.allowed for s in samples if s.allowed is not None]).astype(np.int64))
        return Allowed(counts, starts, ids)

    def pairs(self, at: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """For the scored rows `at` (indices into the (N, T) tensors): (row, id) of every allowed
        token of each masked row, rows in order, as two (P,) tensors on `device`; none for a row
        not masked (the scorer takes its whole vocabulary)."""
        counts, starts = self.counts[at], self.starts[at]
        rows = torch.repeat_interleave(torch.arange(len(counts)), counts)
        first = torch.cumsum(counts, 0) - counts  # each row's first pair
        index = torch.repeat_interleave(starts - first, counts) + torch.arange(len(rows))
        return rows.to(device, non_blocking=True), self.ids[index].to(device, non_blocking=True)


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
    old_values: torch.Tensor | None  # (M,)
    returns: torch.Tensor | None  # (M,)
    ref_logprobs: torch.Tensor | None  # (M,)
    refused: torch.Tensor  # (M,) the refused turn each token belongs to (0: none)
    cpu_rows: tuple[torch.Tensor, torch.Tensor]  # the rows as indices into the Batch's (N, T) tensors
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (P,) row and (P,) id of each token a mask allowed


def collate(groups: list[RolloutGroup], algorithm: str = "grpo", pad_id: int = 0, stale: list[bool] | None = None,
            gamma: float = 1.0, step_weight: float = 1.0, loss_agg: str = "token-mean",
            negative_weight: float = 1.0, refused_turns: str = "train", refused_reward: float = 0.0) -> Batch:
    """Padded tensors of the groups' samples, with each token's advantage by `algorithm`
    (learner.algorithm); samples of groups without signal get loss mask 0. `stale`: per sample,
    whether some token came from weights older than the learner's (None: none did); `gamma`,
    `step_weight`: GiGPO's discount and weight of its step-level advantages; `loss_agg`
    "seq-mean-token-mean": each trained sample's advantages scaled by the batch's mean trained
    tokens a sample over its own, so that the token-mean loss weighs every sample alike;
    `negative_weight`: the factor on each negative advantage (learner.negative_weight); `refused_turns`
    (learner.refused_turns): "drop" takes the turns the env refused out of the loss, "nonpositive" caps
    their advantage at 0 (a sample whose turns cannot be told apart, an agent's, is left as it is);
    `refused_reward`: gigpo's turn reward on each refused turn, in the step returns only. With a
    critic (ppo) the advantages are left at 0 for the trainer."""
    samples = [s for g in groups for s in g.samples]
    T = max(len(s.tokens) for s in samples)
    N = len(samples)
    tokens = torch.full((N, T), pad_id, dtype=torch.long)
    attention = torch.zeros((N, T), dtype=torch.long)
    loss_mask = torch.zeros((N, T), dtype=torch.float32)
    generated = torch.zeros((N, T), dtype=torch.float32)
    behav = torch.zeros((N, T), dtype=torch.float32)
    token_rewards = torch.zeros((N, T), dtype=torch.float32)
    advantages = torch.zeros((N, T), dtype=torch.float32)
    refused = torch.zeros((N, T), dtype=torch.long)
    refused_count = 0
    episode_adv, step_adv, signal = group_advantages(groups, algorithm, gamma, refused_reward)
    sample_signal = [sig for g, sig in zip(groups, signal) for _ in g.samples]
    sample_adv = [float(adv[k]) for g, adv in zip(groups, episode_adv) for k in g.episode_positions()]
    sample_steps = [steps for group_steps in step_adv for steps in group_steps]
    for i, (s, sig, adv, steps) in enumerate(zip(samples, sample_signal, sample_adv, sample_steps)):
        n = len(s.tokens)
        tokens[i, :n] = torch.from_numpy(s.tokens.astype(np.int64))
        attention[i, :n] = 1
        generated[i, :n] = torch.from_numpy(s.loss_mask.astype(np.float32))
        if sig:
            loss_mask[i, :n] = generated[i, :n]
        behav[i, :n] = torch.from_numpy(s.logprobs.copy())
        turns = turn_spans(s.loss_mask)
        advantages[i, :n] = adv * generated[i, :n]
        if steps is not None and len(turns) == len(steps):
            for (a, b), step in zip(turns, steps):
                advantages[i, a:b] += step_weight * step
        for (_a, b), r in zip(turns, turn_reward_split(s, len(turns))):
            token_rewards[i, b - 1] += r
        if len(turns) == s.num_turns:  # not an agent's sample, whose turns cannot be told apart
            for a, b in (turns[k] for k in s.refused_turns):
                refused_count += 1
                refused[i, a:b] = refused_count
                if refused_turns == "train":
                    continue
                if refused_turns == "drop":
                    loss_mask[i, a:b] = 0
                else:
                    advantages[i, a:b].clamp_(max=0.0)
    generated[:, 0] = 0  # the first token has no prediction: always context
    loss_mask[:, 0] = 0
    advantages[:, 0] = 0
    if negative_weight != 1.0:
        advantages = torch.where(advantages < 0, advantages * negative_weight, advantages)
    if loss_agg == "seq-mean-token-mean":
        per_sample = loss_mask.sum(1)
        trained = per_sample > 0
        if trained.any():
            advantages *= torch.where(trained, per_sample[trained].mean() / per_sample.clamp(min=1.0), 1.0)[:, None]
    # Greedy decoding (0) is scored as temperature 1: its log-probs are those of the raw logits.
    temperature = torch.tensor([float(g.sampling.get("temperature", 1.0)) or 1.0
                                for g in groups for _ in g.samples], dtype=torch.float32)
    stale = torch.tensor(stale if stale is not None else [False] * N, dtype=torch.bool)
    return Batch(tokens, attention, loss_mask, generated, behav, advantages, token_rewards, stale, temperature,
                 np.concatenate([g.rewards for g in groups]), np.array(signal), len(groups), refused,
                 allowed=Allowed.of(samples, T))


def group_advantages(groups: list[RolloutGroup], algorithm: str, gamma: float = 1.0, refused_reward: float = 0.0
                     ) -> tuple[list[torch.Tensor], list[list[list[float] | None]], list[bool]]:
    """Per group, by `algorithm`: its episodes' advantages, its samples' step advantages (gigpo's;
    None: a sample without them) and whether it carries signal (with a critic every group does,
    its advantages left at 0 for the trainer)."""
    if algorithm in CRITIC_ALGORITHMS:
        episode_adv, signal = [torch.zeros(len(g.rewards)) for g in groups], [True] * len(groups)
    else:
        episode_adv, signal = estimate("grpo" if algorithm == "gigpo" else algorithm,
                                       [torch.from_numpy(g.rewards) for g in groups])
    step_adv = [gigpo_steps(g, gamma, refused_reward) if algorithm == "gigpo" else [None] * len(g.samples)
                for g in groups]
    if algorithm == "gigpo":  # a group of equal episode rewards may still differ step by step
        # (a sample whose turn states are unknown has no step advantages: None)
        signal = [sig or any(any(a) for a in steps if a is not None) for sig, steps in zip(signal, step_adv)]
    return episode_adv, step_adv, signal


def turn_spans(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of generated tokens: an agent's turns, in order."""
    m = np.concatenate([[0], loss_mask.astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(m))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def turn_reward_split(sample: Sample, turns: int) -> list[float]:
    """The sample's reward as rewards on its `turns` turns: each turn's env reward on its turn, and
    what the reward functions add beyond their sum (or all of it, when the turns cannot be told
    apart) on the last. They sum to the sample's reward."""
    if not turns:
        return []
    per_turn = [float(r) for r in sample.turn_rewards] if len(sample.turn_rewards) == turns else [0.0] * turns
    per_turn[-1] += float(sample.reward) - sum(per_turn)
    return per_turn


def gigpo_steps(group: RolloutGroup, gamma: float, refused_reward: float = 0.0) -> list[list[float] | None]:
    """GiGPO's step-level advantages of a group's samples, a list per sample (None: its turns or
    states are unknown, and it has episode-level advantages only); `refused_reward` is added to the
    reward of each turn the env refused."""
    known = [s if len(s.turn_states) == s.num_turns == len(turn_spans(s.loss_mask)) else None for s in group.samples]
    kept = [s for s in known if s is not None]

    def turn_rewards(s: Sample) -> list[float]:
        rewards = turn_reward_split(s, s.num_turns)
        for k in s.refused_turns:
            rewards[k] += refused_reward
        return rewards

    steps = iter(gigpo_step_advantages([discounted_returns(turn_rewards(s), gamma) for s in kept],
                                       [s.turn_states for s in kept]))
    return [next(steps) if s is not None else None for s in known]


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


def whole_passes(steps: Plan, lengths: np.ndarray, ranks: int, max_tokens: int) -> list[list[list[int]]]:
    """The micro-batches of a no-grad pass over what each rank trains in `steps` (the proximal and
    reference forwards before the first update): each rank's samples of every minibatch cut
    together, into micro-batches of up to `max_tokens`, not minibatch by minibatch (with four
    minibatches that is up to four times fewer, fuller forwards). [rank] -> micro-batches, every
    rank with the same count (an empty list is a rank's idle pass)."""
    return _even([microbatches([i for mb in steps.minibatches for micro in mb[r] for i in micro], lengths, max_tokens)
                  for r in range(ranks)])


def _even(per_rank: list[list[list[int]]]) -> list[list[list[int]]]:
    """Every rank's micro-batches padded with idle passes to as many as the busiest rank runs
    (at least one): each forward is a collective."""
    passes = max(1, max(len(m) for m in per_rank))
    return [m + [[]] * (passes - len(m)) for m in per_rank]


def plan(batch: Batch, minibatches: int, ranks: int, max_tokens: int, rows: list[int] | None = None) -> Plan:
    """The minibatches of the batch's samples `rows` (None: all of them)."""
    lengths = batch.lengths
    padded = real = 0
    out = []
    for mb in split_by_tokens(list(range(len(lengths))) if rows is None else rows, lengths, minibatches):
        if not mb:  # more minibatches than samples: no optimizer step on nothing (AdamW's momentum would move)
            continue
        per_rank = [microbatches(share, lengths, max_tokens) for share in split_by_tokens(mb, lengths, ranks)]
        out.append(_even(per_rank))
        for m in per_rank:
            for micro in m:
                padded += len(micro) * int(lengths[micro].max())
                real += int(lengths[micro].sum())
    if not out:  # no sample to score, a supervised term to train (learner.sft_coef): one update of idle passes
        out.append(_even([[] for _ in range(ranks)]))
    return Plan(out, 1 - real / max(padded, 1))
