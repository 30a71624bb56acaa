"""Optimizer steps on a batch: the batch is cut into minibatches (one optimizer step each,
repeated for `ppo_epochs`), each minibatch across ranks by tokens and into micro-batches of
at most `max_tokens_per_microbatch` padded tokens whose gradients are accumulated. Every
micro-batch's loss is divided by the minibatch's trained-token count, so the step equals
one forward of the whole minibatch on one process.

Proximal log-probs are computed once, before the first update, when there are several
updates per batch under the decoupled loss; with one (the default) they equal the current ones
and are not computed.
The same pass gives the critic's values (learner.algorithm = "ppo"), from which the trainer
computes GAE or V-trace advantages and value targets, and a frozen reference model's
log-probs when the loss has a KL penalty (learner.kl_coef).
"""

from __future__ import annotations

import collections
import copy
import logging
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from common.config import CRITIC_ALGORITHMS, LearnerConfig
from common.models import write_safetensors
from common.timing import Timer
from common.weight_sync import Packed, pack
from learner.algorithms import (
    LossConfig,
    add_stats,
    gae,
    kl_penalty,
    loss_metrics,
    policy_loss,
    refused_unlikelihood,
    tis_loss,
    value_loss,
    vtrace,
)
from learner.batch import Batch, MicroBatch, microbatches, plan, whole_passes
from learner.checkpoint import load_shards, save_shards
from learner.distributed import Single, resolve_device
from learner.scoring import PolicyScorer, padded_examples

log = logging.getLogger(__name__)

PREFIX = "lm."  # the scorer's name for the causal LM inside it
# Summed over micro-batches, updates and ranks.
STATS = ("tokens", "kept", "w", "w2", "kl", "truncated", "rejected", "clipped", "ratio", "loss", "entropy",
         "generated", "value_loss", "kl_ref", "refused_n", "refused_p", "refused_ul", "sft_nll", "sft_tokens")


def place(model: torch.nn.Module, cfg: LearnerConfig, device: torch.device) -> torch.nn.Module:
    """The model on the training device in fp32 (master weights; bf16 only inside `autocast`),
    recomputing each layer's activations in backward with learner.gradient_checkpointing.
    RL's Trainer and SFT's take their model through here."""
    model = model.to(device)
    if cfg.gradient_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def autocast(device: torch.device, precision: str):
    """learner.precision's compute: bf16 autocast over the fp32 weights, or plain fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def supervised_nll(scorer: torch.nn.Module, examples: list, device: torch.device, precision: str
                   ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The summed negative log-likelihood of the trained tokens of `examples` ((tokens, loss_mask)
    arrays) padded together, the scorer's values (None without a value head) and the count of those
    tokens: SFT's loss and RL's supervised term (learner.sft_coef)."""
    tokens, attention, rows = padded_examples(examples, device)
    with autocast(device, precision):
        logp, _entropy, values = scorer(tokens, attention, rows, torch.ones(len(rows), device=device))
    return -logp.float().sum(), values, len(rows)


REFERENCE_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}  # the KL reference is kept in the compute's precision


class Trainer:
    """`reference`: the frozen starting policy for the KL penalty (learner.kl_coef > 0), as the
    parallel layer loaded it (`parallel.load_model(path, REFERENCE_DTYPE[precision], trainable=False)`:
    sharded under FSDP2); unset, a copy of `model` in that dtype. `sft_examples`: the episodes
    (tokens, loss_mask arrays) of the supervised term (learner.sft_coef; `learner.sft.read_examples`)."""

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, parallel: Single | None = None,
                 reference: torch.nn.Module | None = None,
                 sft_examples: Sequence[tuple[np.ndarray, np.ndarray]] = ()):
        self.cfg = cfg
        self.sft_examples = list(sft_examples) if cfg.sft_coef > 0 else []
        if cfg.sft_coef > 0 and not self.sft_examples:
            raise ValueError("learner.sft_coef > 0 needs the episodes of learner.sft_data: pass sft_examples")
        self.parallel = parallel or Single(resolve_device(cfg.device, 0))
        self.device = self.parallel.device
        self.model = place(model, cfg, self.device)
        self.critic = cfg.algorithm in CRITIC_ALGORITHMS
        self.reference: PolicyScorer | None = None  # the frozen starting policy, for the KL penalty
        if cfg.kl_coef > 0:
            if reference is None:
                reference = copy.deepcopy(model).to(getattr(torch, REFERENCE_DTYPE[cfg.precision]))
            self.reference = self.parallel.wrap(PolicyScorer(reference.eval().requires_grad_(False), cfg.vocab_chunk),
                                                frozen=True)
        self.scorer = self.parallel.wrap(PolicyScorer(model, cfg.vocab_chunk, value_head=self.critic))  # placed by wrap
        named = list(self.scorer.named_parameters())
        policy = [p for n, p in named if "value_head." not in n]
        head = [p for n, p in named if "value_head." in n]
        self.optimizer = torch.optim.AdamW([{"params": policy}] + ([{"params": head, "lr": cfg.critic_lr or cfg.lr}]
                                                                    if head else []),
                                           lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.loss_cfg = LossConfig(cfg.clip_eps_low, cfg.clip_eps_high, cfg.behav_weight_cap, cfg.behav_reject,
                                   cfg.dual_clip)
        self.timer = Timer()
        self.skipped_nonfinite = 0  # optimizer steps skipped for a non-finite loss or gradient
        self.copying: Future | None = None  # a checkpoint's copy of the state, taken in the background

    def _autocast(self):
        return autocast(self.device, self.cfg.precision)

    def _score(self, mb: MicroBatch, scorer: torch.nn.Module | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        with self._autocast():
            return (scorer or self.scorer)(mb.tokens, mb.attention_mask, mb.rows, mb.temperature, mb.allowed)  # (M,) each

    def train_step(self, batch: Batch) -> dict[str, float]:
        cfg, rank = self.cfg, self.parallel.rank
        unlikely = cfg.refused_unlikelihood > 0 and bool(batch.refused.any())
        if batch.num_trained_tokens == 0 and cfg.entropy_coef == 0 and not unlikely and not self.sft_examples:
            return {"learner/skipped": 1.0}
        self.scorer.train()
        # Only the samples the loss reads are scored: a group without signal has loss mask 0, so
        # unless a term over every generated token is on (the entropy bonus, the refused turns'
        # unlikelihood) its samples would cost a forward and a backward for no gradient.
        every_generated = cfg.entropy_coef > 0 or unlikely
        scored = (batch.generated_mask if every_generated else batch.loss_mask).sum(1) > 0
        rows = scored.nonzero().flatten().tolist()
        steps = plan(batch, cfg.minibatches, self.parallel.world, cfg.max_tokens_per_microbatch, rows)
        updates = cfg.ppo_epochs * len(steps.minibatches)
        mine = [micro for mb in steps.minibatches for micro in mb[rank]]
        # The proximal policy (the weights before the first update) is the decoupled loss's, and the critic's.
        proximal = (updates > 1 and cfg.loss == "decoupled") or self.critic
        # This step's own: a batch trained on before (a benchmark's, a test's) must not bring another
        # step's proximal or reference log-probs into this one.
        batch.prox_logprobs = batch.old_values = batch.ref_logprobs = None
        if proximal or self.reference is not None:
            with self.timer("proximal"):
                passes = whole_passes(steps, batch.lengths, self.parallel.world, cfg.max_tokens_per_microbatch)
                self._before_update(batch, passes[rank], policy=proximal)
        vtrace_share = self._critic_advantages(batch, mine) if self.critic else 0.0
        totals: dict[str, torch.Tensor] = {}
        grad_norms = []
        for _ in range(cfg.ppo_epochs):
            for mb in steps.minibatches:
                stats, grad_norm = self._update(batch, mb)
                totals = add_stats(totals, stats)
                grad_norms.append(grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        summed = dict(zip(STATS, self.parallel.sum([float(totals.get(k, 0.0)) for k in STATS])))
        metrics = {f"learner/{k}": v for k, v in loss_metrics(summed).items()}
        metrics["learner/lr"] = self.optimizer.param_groups[0]["lr"]
        if self.critic:
            metrics["learner/loss/value"] = summed["value_loss"] / updates
            metrics["learner/vtrace_frac"] = vtrace_share
        if self.reference is not None:
            metrics["learner/kl_ref"] = summed["kl_ref"] / updates
        if self.sft_examples:  # the supervised term's NLL per trained token, over every update's episodes
            metrics["learner/loss/sft"] = summed["sft_nll"] / max(summed["sft_tokens"], 1.0)
        if summed["refused_n"]:  # the policy's probability of the actions the env refused, as it trained on them
            metrics["learner/refused_prob"] = summed["refused_p"] / summed["refused_n"]
            if cfg.refused_unlikelihood:
                metrics["learner/loss/refused"] = summed["refused_ul"] / summed["refused_n"]
        metrics.update({
            "learner/loss/policy": summed["loss"] / updates,
            "learner/entropy": summed["entropy"] / max(summed["generated"], 1.0),
            "learner/grad_norm": sum(grad_norms) / len(grad_norms),
            "learner/skipped_nonfinite": float(self.skipped_nonfinite),
            "learner/updates": float(updates),
            "learner/microbatches": float(sum(len(mb[rank]) for mb in steps.minibatches)),
            "learner/padding_frac": steps.padding_frac,
            "learner/scored_frac": len(rows) / len(scored),
        })
        metrics.update(self.timer.pop("learner/time/"))
        return metrics

    @torch.no_grad()
    def _before_update(self, batch: Batch, micros: list[list[int]], policy: bool) -> None:
        """For this rank's samples: the log-probs (and values) of the weights before the first
        update (`policy`), and the reference policy's log-probs."""
        zeros = lambda: torch.zeros_like(batch.behav_logprobs)  # noqa: E731
        if policy:
            batch.prox_logprobs = zeros()
            batch.old_values = zeros() if self.critic else None
        if self.reference is not None:
            batch.ref_logprobs = zeros()
        for idx in micros:
            if not idx:  # an idle pass: the other ranks' forwards are collectives, the reference's too
                if policy:
                    self._idle_loss()
                if self.reference is not None:
                    self._idle_loss(self.reference)
                continue
            mb = batch.micro(idx, self.device)
            if policy:
                logp, _, values = self._score(mb)
                batch.prox_logprobs[mb.cpu_rows] = logp.float().cpu()
                if values is not None:
                    batch.old_values[mb.cpu_rows] = values.float().cpu()
            if self.reference is not None:
                batch.ref_logprobs[mb.cpu_rows] = self._score(mb, self.reference)[0].float().cpu()

    def _critic_advantages(self, batch: Batch, micros: list[list[int]]) -> float:
        """GAE or V-trace advantages and value targets for this rank's samples, from the values
        before the update; the advantages are then centred (and with learner.scale_advantages
        divided by their std) over every rank's trained tokens. Returns the share of the batch's
        samples that took V-trace."""
        cfg = self.cfg
        mask = torch.zeros_like(batch.loss_mask)
        mine = sorted({i for idx in micros for i in idx})
        mask[mine] = batch.loss_mask[mine]
        adv, returns = gae(batch.token_rewards, batch.old_values, mask, cfg.gamma, cfg.gae_lambda)
        use_vtrace = {"gae": torch.zeros_like(batch.stale), "vtrace": torch.ones_like(batch.stale),
                      "auto": batch.stale}[cfg.critic_targets]
        if bool(use_vtrace[mine].any()):
            log_rhos = (batch.prox_logprobs - batch.behav_logprobs) * mask
            adv_v, returns_v = vtrace(batch.token_rewards, batch.old_values, log_rhos, mask, cfg.gamma,
                                      cfg.gae_lambda, cfg.vtrace_rho_bar, cfg.vtrace_c_bar)
            adv = torch.where(use_vtrace[:, None], adv_v, adv)
            returns = torch.where(use_vtrace[:, None], returns_v, returns)
        total, squares, count = self.parallel.sum([float((adv * mask).sum()), float((adv ** 2 * mask).sum()),
                                                   float(mask.sum())])
        mean = total / max(count, 1.0)
        std = max(squares / max(count, 1.0) - mean ** 2, 0.0) ** 0.5
        batch.advantages = (adv - mean) / (std + 1e-6 if cfg.scale_advantages else 1.0) * mask
        batch.returns = returns
        return float(use_vtrace.float().mean())

    def _update(self, batch: Batch, minibatch: list[list[list[int]]]) -> tuple[dict[str, torch.Tensor], float]:
        """One optimizer step on a minibatch (every rank's micro-batches); returns this rank's
        summed stats and the global gradient norm."""
        every = [i for micros in minibatch for idx in micros for i in idx]
        n_train = batch.loss_mask[every].sum().clamp(min=1.0).item()
        # Dr.GRPO: each sample's token sum over a constant, so long and short answers weigh alike per token.
        n_policy = len(every) * self.cfg.token_sum_norm if self.cfg.algorithm == "drgrpo" and self.cfg.token_sum_norm \
            else n_train
        n_gen = batch.generated_mask[every].sum().clamp(min=1.0).item()
        # DDP and FSDP2 average gradients over ranks; the loss is a sum over the whole minibatch.
        scale = float(self.parallel.world)
        # This rank's micro-batches, then the supervised term's (learner.sft_coef); gradients sync at the last.
        passes: list = [(False, idx) for idx in minibatch[self.parallel.rank]]
        n_sft = 0.0
        if self.sft_examples:
            parts, n_sft = self._sft_parts()
            passes += [(True, part) for part in parts]
        stats: dict[str, torch.Tensor] = {}
        for j, (supervised, idx) in enumerate(passes):
            with self.parallel.no_grad_sync(self.scorer, skip=j < len(passes) - 1):
                with self.timer("forward"):
                    loss, mb_stats = self._sft_loss(idx, n_sft) if supervised else \
                        self._micro_loss(batch, idx, n_train, n_policy, n_gen)
                with self.timer("backward"):
                    (loss * scale).backward()
            stats = add_stats(stats, mb_stats)
        with self.timer("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.scorer.parameters(), self.cfg.grad_clip)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            # Bad numbers never reach the weights: a non-finite loss or gradient on any rank skips the update.
            [bad] = self.parallel.sum([float(not torch.isfinite(stats.get("loss", torch.zeros(()))))])
            finite = bool(torch.isfinite(grad_norm)) and bad == 0
        with self.timer("checkpoint_copy"):
            self._settled()  # a checkpoint's copy must hold the state before this update changes it
        with self.timer("optimizer"):
            if finite:
                self._warm_up()
                self.optimizer.step()
            else:
                self.skipped_nonfinite += 1
                log.warning("non-finite loss (%s) or gradient norm (%s): optimizer step skipped (%d so far)",
                            float(stats.get("loss", 0.0)), float(grad_norm), self.skipped_nonfinite)
            # Freed now, not before the next backward: kept, they would sit through the next forward
            # (`omrl bench learner` measured 4% more peak memory on a 100M model).
            self.optimizer.zero_grad(set_to_none=True)
        return stats, float(grad_norm)

    def _updates_done(self) -> int:
        """AdamW's own count of its updates, which a checkpoint keeps: a resumed run goes on from it."""
        first = self.optimizer.param_groups[0]["params"][0]
        return int(self.optimizer.state.get(first, {}).get("step", 0))

    def _warm_up(self) -> None:
        """learner.lr_warmup_steps: the learning rate rises linearly to learner.lr over that many
        steps' updates, counted by `_updates_done`. A fresh AdamW's first updates move every weight by
        about lr, whatever its gradient's size (its moments hold one gradient: m / sqrt(v) = +-1)."""
        warmup = self.cfg.lr_warmup_steps * self.cfg.ppo_epochs * self.cfg.minibatches
        if warmup == 0:
            return
        done = self._updates_done()
        for group, lr in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = lr * min(1.0, (done + 1) / warmup)

    def _micro_loss(self, batch: Batch, idx: list[int], n_train: float, n_policy: float, n_gen: float
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """n_train: the minibatch's trained tokens (the value and KL terms' denominator); n_policy:
        the policy term's (the same, but for Dr.GRPO); n_gen: its generated tokens (the entropy's)."""
        if not idx:  # this rank's idle pass: the collectives of a forward and backward, no gradient
            return self._idle_loss(), {}
        cfg = self.cfg
        mb = batch.micro(idx, self.device)
        cur, entropy, values = self._score(mb)  # (M,) each
        if cfg.loss == "tis":
            pg_loss, stats = tis_loss(cur, mb.behav_logprobs, mb.advantages, mb.loss_mask, self.loss_cfg, n_policy)
        else:
            if cfg.loss == "naive":  # the behaviour policy as the proximal one: no correction for staleness
                prox = mb.behav_logprobs
            else:
                prox = mb.prox_logprobs if mb.prox_logprobs is not None else cur.detach()
            pg_loss, stats = policy_loss(cur, prox, mb.behav_logprobs, mb.advantages, mb.loss_mask, self.loss_cfg,
                                         norm_tokens=n_policy)
        # Over every generated token, groups without signal included: that is where a
        # collapsed (deterministic) policy needs the push back towards exploring.
        loss = pg_loss - cfg.entropy_coef * entropy.sum() / n_gen
        stats.update(loss=pg_loss.detach(), entropy=entropy.detach().sum(), generated=torch.tensor(float(len(cur))))
        ul, probs = refused_unlikelihood(cur, mb.refused)
        if len(ul):
            if cfg.refused_unlikelihood:  # over every generated token, as the entropy: groups without signal too
                loss = loss + cfg.refused_unlikelihood * ul.sum() / n_gen
            stats.update(refused_n=torch.tensor(float(len(ul))), refused_p=probs.detach().sum(),
                         refused_ul=ul.detach().sum())
        if values is not None:
            v_loss = value_loss(values, mb.returns, mb.old_values, mb.loss_mask, cfg.vf_clip) / n_train
            loss = loss + cfg.vf_coef * v_loss
            stats["value_loss"] = v_loss.detach()
        if mb.ref_logprobs is not None:
            kl = (kl_penalty(cur, mb.ref_logprobs, cfg.kl_estimator) * mb.loss_mask).sum() / n_train
            loss = loss + cfg.kl_coef * kl
            stats["kl_ref"] = kl.detach()
        return loss, {k: v.detach().float().cpu() for k, v in stats.items()}

    def _sft_parts(self) -> tuple[list[list[tuple[np.ndarray, np.ndarray]]], float]:
        """This update's learner.sft_episodes episodes of learner.sft_data, drawn from the seed and
        the update's count (every rank draws the same ones; a resumed run draws what it would
        have): this rank's share of them cut into micro-batches, as many as the rank with the most
        (an empty one is an idle pass), and the trained tokens of all of them."""
        cfg, world = self.cfg, self.parallel.world
        rng = np.random.default_rng([cfg.seed % 2 ** 32, self._updates_done()])
        drawn = [self.sft_examples[i] for i in
                 rng.choice(len(self.sft_examples), min(cfg.sft_episodes, len(self.sft_examples)), replace=False)]
        parts = []
        for rank in range(world):
            share = drawn[rank::world]
            lengths = np.array([len(t) for t, _m in share])
            parts.append([[share[i] for i in idx] for idx in
                          microbatches(list(range(len(share))), lengths, cfg.max_tokens_per_microbatch)])
        mine = parts[self.parallel.rank]
        mine += [[] for _ in range(max(map(len, parts)) - len(mine))]
        return mine, float(sum(int(m[1:].sum()) for _t, m in drawn))

    def _sft_loss(self, examples: list, n_sft: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """learner.sft_coef times the summed NLL of the trained tokens of `examples` over the update's
        `n_sft` trained tokens of the supervised term."""
        if not examples:
            return self._idle_loss(), {}
        nll, values, n = supervised_nll(self.scorer, examples, self.device, self.cfg.precision)
        loss = self.cfg.sft_coef * nll / max(n_sft, 1.0)
        if values is not None:  # the value head in the graph: the gradients' sync expects every parameter
            loss = loss + values.sum() * 0.0
        return loss, {"sft_nll": nll.detach().cpu(), "sft_tokens": torch.tensor(float(n))}

    def _idle_loss(self, scorer: torch.nn.Module | None = None) -> torch.Tensor:
        tokens = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        rows = torch.tensor([[0, 1]], device=self.device)
        with self._autocast():
            cur, _, values = (scorer or self.scorer)(tokens, torch.ones_like(tokens), rows,
                                                     torch.ones(1, device=self.device))
        return (cur.sum() + (values.sum() if values is not None else 0.0)) * 0.0

    def save_checkpoint(self, path: Path, background: bool) -> Future:
        """Write this rank's shards of the model and optimizer state into checkpoint directory
        `path` (`learner.checkpoint.save_shards`; every rank must call it). Returns the future of
        the write; in the background the state is copied beside the next step, whose optimizer
        step waits for the copy (learner/time/checkpoint_copy_s)."""
        self._settled()
        self.copying, written = save_shards(self.parallel.train_state(self.scorer, self.optimizer), path,
                                            self.parallel.checkpoint_group, background)
        return written

    def _settled(self) -> None:
        copying, self.copying = self.copying, None
        if copying is not None:
            copying.result()

    def load_checkpoint(self, path: Path) -> None:
        """The model and optimizer state of checkpoint `path`, written at any rank count (every
        rank must call it)."""
        self._settled()
        state = self.parallel.train_state(self.scorer, self.optimizer)
        load_shards(state, path, self.parallel.checkpoint_group)
        self.parallel.load_train_state(self.scorer, self.optimizer, state)

    def _policy(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The policy's tensors as the Hugging Face checkpoint names them, one at a time
        (`gathered`: on rank 0, None elsewhere); a tied output layer left out, as save_pretrained
        does. Every rank must run it to its end."""
        return ((name[len(PREFIX):], tensor) for name, tensor in self.parallel.gathered(self.scorer, dtype)
                if name.startswith(PREFIX))

    def hf_state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The policy's weights on CPU in `dtype` (the training dtype when None), on rank 0 (empty
        elsewhere; every rank must call it)."""
        return {name: tensor for name, tensor in self._policy(dtype) if tensor is not None}

    def save_weights(self, path: str | Path, dtype: torch.dtype = torch.float32) -> int:
        """The policy's weights as a safetensors file at `path` in the actors' `dtype`, written
        tensor by tensor as they are gathered: what it adds to rank 0's memory is one tensor,
        never the file's bytes. Its size on rank 0 (0 elsewhere); every rank must call it."""
        tensors = self._policy(dtype)
        if not self.parallel.is_main:
            collections.deque(tensors, maxlen=0)  # the gathers are collectives
            return 0
        layout = [(name[len(PREFIX):], shape, dt) for name, shape, dt in self.parallel.layout(self.scorer, dtype)
                  if name.startswith(PREFIX)]
        try:
            return write_safetensors(path, layout, tensors)
        except BaseException:
            collections.deque(tensors, maxlen=0)  # the other ranks' gathers wait for this rank's
            raise

    def weights_packed(self, version: int, dtype: torch.dtype, bucket_bytes: int, device) -> Packed | None:
        """The weights in buckets for the broadcast transport, in the actors' `dtype` on `device`
        (rank 0; every rank must call it; the buckets are copies, so training may go on). Packed as
        they are gathered: the learner holds the buckets and one bucket's tensors besides."""
        tensors = self._policy(dtype)
        if not self.parallel.is_main:
            collections.deque(tensors, maxlen=0)  # the gathers are collectives
            return None
        return pack(version, tensors, bucket_bytes, device)


def learn(trainer: Trainer, batches: Iterable[Batch]) -> Iterator[dict[str, float]]:
    """Train on each batch in turn; a test passes a list, the worker a broker-fed iterator."""
    for batch in batches:
        yield trainer.train_step(batch)
