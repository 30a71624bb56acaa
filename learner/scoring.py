"""Token log-probs and entropies from a causal LM, without a (N, T, V) logits tensor.

The backbone runs on the whole micro-batch; the output layer runs only on the rows that
predict a scored token (the generated ones), in chunks of rows and of the vocabulary, and
its backward recomputes each chunk's logits instead of keeping them. Peak memory of the
head is `row_chunk * vocab_chunk` floats, whatever the batch or the vocabulary.

Logits are divided by the sampling temperature of their row first, so the learner scores
tokens under the distribution the actor sampled from (vLLM's `processed_logprobs`). A row the
actor's mask restricted (actor.constrain_actions: Sample.allowed) is scored over its allowed
tokens only (`masked_logprobs`), the distribution the actor sampled it from.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.distributed.tensor import DTensor

from learner.vocab_parallel import VocabRows, gather_rows

ROW_CHUNK = 4096
"""Rows of the output layer computed at once (with `vocab_chunk` columns)."""


class _HeadLogprobs(torch.autograd.Function):
    """hidden (M, H), weight (V, H), targets (M,), inv_temp (M,) -> logp (M,), entropy (M,), fp32.
    With `vocab` (VocabRows), `weight` is the parameter split by vocabulary (scored on this rank's
    rows, its gradient added into theirs in place), `targets` numbered from its first row, and the
    rows every rank's: the log-sum-exp's pieces are all-reduced.

    l = (hidden @ weight.T) * inv_temp; logp = l[target] - logsumexp(l); entropy = lse - E_p[l].
    Backward: d logp / d l = onehot - p; d entropy / d l = -p * (l - E_p[l]).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, vocab_chunk, compute_dtype, vocab):
        param, weight = weight, weight.to_local() if vocab is not None else weight
        M, V = hidden.shape[0], weight.shape[0]
        # Per row over this weight's vocabulary: running max, sum exp(l - max), sum exp(l - max) * l,
        # and the target's logit (0 where the target is not in these rows).
        parts = hidden.new_empty((4, M), dtype=torch.float32)  # rows: contiguous for the collectives
        for r0 in range(0, M, ROW_CHUNK):
            h = hidden[r0:r0 + ROW_CHUNK].to(compute_dtype)
            scale = inv_temp[r0:r0 + ROW_CHUNK, None]
            tgt = targets[r0:r0 + ROW_CHUNK]
            run_max = torch.full((h.shape[0], 1), -float("inf"), device=h.device)
            run_sum = torch.zeros((h.shape[0], 1), device=h.device)  # sum exp(l - max)
            run_dot = torch.zeros((h.shape[0], 1), device=h.device)  # sum exp(l - max) * l
            picked = torch.zeros(h.shape[0], device=h.device)
            for v0 in range(0, V, vocab_chunk):
                logits = (h @ weight[v0:v0 + vocab_chunk].to(compute_dtype).T).float() * scale  # (m, v)
                new_max = torch.maximum(run_max, logits.max(-1, keepdim=True).values)
                rescale = torch.exp(run_max - new_max)
                e = torch.exp(logits - new_max)
                run_sum = run_sum * rescale + e.sum(-1, keepdim=True)
                run_dot = run_dot * rescale + (e * logits).sum(-1, keepdim=True)
                run_max = new_max
                inside = (tgt >= v0) & (tgt < v0 + logits.shape[1])
                idx = (tgt - v0).clamp(0, logits.shape[1] - 1)
                picked += torch.where(inside, logits.gather(1, idx[:, None]).squeeze(1), 0.0)
            parts[:, r0:r0 + ROW_CHUNK] = torch.stack([run_max[:, 0], run_sum[:, 0], run_dot[:, 0], picked])
        if vocab is not None:  # each rank scored its slice of the vocabulary: the rows' totals over all
            run_max = vocab.combine(parts[0].clone(), dist.ReduceOp.MAX)
            parts[1:3] *= torch.exp(parts[0] - run_max)
            parts[0] = run_max
            vocab.combine(parts[1:])
        run_max, run_sum, run_dot, picked = parts
        lse = run_max + torch.log(run_sum)
        mean_l = run_dot / run_sum
        ctx.save_for_backward(hidden, weight, targets, inv_temp, lse, mean_l)
        ctx.vocab_chunk, ctx.compute_dtype, ctx.vocab, ctx.param = vocab_chunk, compute_dtype, vocab, param
        return picked - lse, lse - mean_l

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, inv_temp, lse, mean_l = ctx.saved_tensors
        vocab_chunk, dt = ctx.vocab_chunk, ctx.compute_dtype
        if ctx.vocab is not None:  # each rank's rows' gradients (zero elsewhere): every rank needs all of them
            grads = ctx.vocab.combine(torch.stack([grad_logp.float(), grad_entropy.float()]))
            grad_logp, grad_entropy = grads[0], grads[1]
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32)
        # Split by vocabulary: added into the parameter's gradient in place, a rank's share of every rank's rows.
        grad_weight = ctx.vocab.grad_of(ctx.param) if ctx.vocab is not None else \
            torch.zeros_like(weight, dtype=torch.float32)
        share = 1.0 / ctx.vocab.world if ctx.vocab is not None else 1.0
        V = weight.shape[0]
        for r0 in range(0, hidden.shape[0], ROW_CHUNK):
            rows = slice(r0, r0 + ROW_CHUNK)
            h, scale, tgt = hidden[rows].to(dt), inv_temp[rows, None], targets[rows]
            g_lp, g_ent = grad_logp[rows, None].float(), grad_entropy[rows, None].float()
            for v0 in range(0, V, vocab_chunk):
                w = weight[v0:v0 + vocab_chunk].to(dt)
                logits = (h @ w.T).float() * scale  # (m, v)
                p = torch.exp(logits - lse[rows, None])
                grad_logits = -p * (g_lp + g_ent * (logits - mean_l[rows, None]))
                inside = (tgt >= v0) & (tgt < v0 + logits.shape[1])
                idx = (tgt - v0).clamp(0, logits.shape[1] - 1)
                grad_logits.scatter_add_(1, idx[:, None], torch.where(inside, g_lp[:, 0], 0.0)[:, None])
                grad_logits = (grad_logits * scale).to(dt)  # through l = raw * inv_temp
                grad_hidden[rows] += (grad_logits @ w).float()
                grad_weight[v0:v0 + vocab_chunk].add_(grad_logits.T @ h, alpha=share)
        grad_weight = None if ctx.vocab is not None else grad_weight.to(weight.dtype)
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                  vocab_chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (M, H), output weight (V, H), targets (M,), temperature (M,) -> log-prob of each
    target and entropy of each row's distribution at its temperature, both (M,) fp32. A weight
    split by vocabulary across the ranks (a DTensor: `learner.vocab_parallel`) is scored in place:
    every rank's rows against each rank's slice, never gathered."""
    compute_dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
        else weight.dtype
    inv_temp = 1.0 / temperature.float()
    # The chunks pick their own dtypes; autocast would recast them behind our back.
    with torch.autocast(hidden.device.type, enabled=False):
        if not isinstance(weight, DTensor):
            return _HeadLogprobs.apply(hidden, weight, targets, inv_temp, vocab_chunk, compute_dtype, None)
        vocab = VocabRows(weight)
        counts = vocab.counts(len(hidden))
        every_target = vocab.gather_rows(targets, counts) - vocab.lo  # numbered from this rank's first row
        logp, entropy = _HeadLogprobs.apply(gather_rows(hidden, vocab, counts), weight, every_target,
                                            vocab.gather_rows(inv_temp, counts), vocab_chunk, compute_dtype, vocab)
        mine = vocab.mine(counts)
        return logp[mine], entropy[mine]


def _pair_logits(hidden: torch.Tensor, weight: torch.Tensor, pair_rows: torch.Tensor, pair_ids: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """hidden[row] . weight[id] of each (row, id) pair, (P,) fp32, through (P, H) gathers in `dtype`."""
    return (hidden[pair_rows].to(dtype) * weight[pair_ids].to(dtype)).sum(-1).float()


def masked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                    pair_rows: torch.Tensor, pair_ids: torch.Tensor, pair_chunk: int = 8192
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (M, H), output weight (V, H), targets (M,), temperature (M,); each row's allowed
    tokens as (row, id) pairs, (P,) each, every row with at least one -> log-prob of each target
    and entropy of each row's distribution renormalised over its allowed tokens, (M,) fp32:
    l = hidden . weight[id] / temperature; logp = l[target] - logsumexp over the row's ids. Only the
    allowed rows of the weight are read, `pair_chunk` pairs at a time (gathered: 2 x pair_chunk x H
    values); with more pairs than that each chunk's gathers are recomputed in backward instead of
    kept, so the head's peak stays there whatever P is. A weight split by vocabulary is refused."""
    if isinstance(weight, DTensor):
        raise NotImplementedError("rows masked by actor.constrain_actions are not scored with the output layer split "
                                  "by vocabulary: set learner.vocab_parallel = false")
    compute_dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
        else weight.dtype
    with torch.autocast(hidden.device.type, enabled=False):
        if len(pair_rows) <= pair_chunk:
            dots = _pair_logits(hidden, weight, pair_rows, pair_ids, compute_dtype)
        else:
            dots = torch.cat([
                torch.utils.checkpoint.checkpoint(_pair_logits, hidden, weight, pair_rows[i:i + pair_chunk],
                                                  pair_ids[i:i + pair_chunk], compute_dtype, use_reentrant=False)
                for i in range(0, len(pair_rows), pair_chunk)])
        logits = dots / temperature.float()[pair_rows]  # (P,)
        M = len(hidden)
        shift = torch.full((M,), -float("inf"), device=logits.device).scatter_reduce(
            0, pair_rows, logits.detach(), "amax")  # a constant for stability: the gradient is lse's
        total = torch.zeros(M, device=logits.device).index_add(0, pair_rows, torch.exp(logits - shift[pair_rows]))
        lse = shift + torch.log(total)
        p = torch.exp(logits - lse[pair_rows])
        picked = torch.zeros(M, device=logits.device).index_add(
            0, pair_rows, torch.where(pair_ids == targets[pair_rows], logits, 0.0))
        mean_l = torch.zeros(M, device=logits.device).index_add(0, pair_rows, p * logits)
        return picked - lse, lse - mean_l


class PolicyScorer(torch.nn.Module):
    """A Hugging Face causal LM (`get_decoder()` and `get_output_embeddings()`, as Qwen2,
    Llama and most decoders have) that returns the log-prob and entropy of chosen tokens.

    The wrapper is the module DDP and FSDP2 wrap: the output layer's weight is used inside
    its forward, where FSDP2 has it unsharded.
    """

    def __init__(self, lm: torch.nn.Module, vocab_chunk: int = 8192, value_head: bool = False):
        super().__init__()
        head = lm.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            raise ValueError(f"{type(lm).__name__}: the learner needs an output layer without bias")
        self.lm, self.vocab_chunk = lm, vocab_chunk
        # The critic (learner.algorithm = "ppo"): a linear value of the state each token is sampled in,
        # on the policy's last hidden state. Zero at first, so the first advantages are the returns.
        self.value_head = None
        if value_head:
            self.value_head = torch.nn.Linear(lm.config.hidden_size, 1)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor,
                temperature: torch.Tensor, allowed: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """tokens, attention_mask (N, T); rows (M, 2) of (sample, t) with t >= 1: score tokens[n, t]
        given tokens[n, :t]; temperature (M,); `allowed`: (row, id) pairs of the rows a mask
        restricted (MicroBatch.allowed), scored over those ids only. Returns logp, entropy and, with a
        value head, the value of the state before each token (else None), all (M,) fp32."""
        hidden = self.lm.get_decoder()(input_ids=tokens, attention_mask=attention_mask).last_hidden_state  # (N, T, H)
        picked = hidden[rows[:, 0], rows[:, 1] - 1]  # (M, H): the position before each scored token
        targets = tokens[rows[:, 0], rows[:, 1]]
        weight = self.lm.get_output_embeddings().weight
        if allowed is None or not len(allowed[0]):
            logp, entropy = head_logprobs(picked, weight, targets, temperature, self.vocab_chunk)
        else:  # the masked rows over their allowed tokens, the others over the vocabulary
            pair_rows, pair_ids = allowed
            masked = torch.zeros(len(rows), dtype=torch.bool, device=rows.device)
            masked[pair_rows] = True
            into = torch.cumsum(masked, 0) - 1  # each masked row's place among them
            m_idx, u_idx = masked.nonzero()[:, 0], (~masked).nonzero()[:, 0]
            m_logp, m_ent = masked_logprobs(picked[m_idx], weight, targets[m_idx], temperature[m_idx],
                                            into[pair_rows], pair_ids, self.vocab_chunk)
            u_logp, u_ent = head_logprobs(picked[u_idx], weight, targets[u_idx], temperature[u_idx], self.vocab_chunk)
            order = torch.argsort(torch.cat([m_idx, u_idx]))
            logp, entropy = torch.cat([m_logp, u_logp])[order], torch.cat([m_ent, u_ent])[order]
        values = None if self.value_head is None else self.value_head(picked).float().squeeze(-1)
        return logp, entropy, values


def plain_logprobs(lm: torch.nn.Module, tokens: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: full logits, log_softmax, gather. Same signature as PolicyScorer's forward
    less the mask (tests compare the two)."""
    logits = lm(input_ids=tokens).logits.float()[rows[:, 0], rows[:, 1] - 1] / temperature[:, None]  # (M, V)
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, tokens[rows[:, 0], rows[:, 1]][:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)



def padded_examples(examples: list, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Episodes' (tokens, loss_mask) padded together, for PolicyScorer: tokens, attention mask
    and the rows (sample, position) of their trained tokens (never position 0, which nothing
    predicts). What SFT and the learner's SFT term (learner.sft_coef) score."""
    T = max(len(t) for t, _m in examples)
    tokens = torch.zeros((len(examples), T), dtype=torch.long)
    attention = torch.zeros((len(examples), T), dtype=torch.long)
    trained = torch.zeros((len(examples), T), dtype=torch.bool)
    for i, (t, m) in enumerate(examples):
        tokens[i, :len(t)] = torch.as_tensor(t)
        attention[i, :len(t)] = 1
        trained[i, :len(m)] = torch.as_tensor(m, dtype=torch.bool)
    trained[:, 0] = False
    return tokens.to(device), attention.to(device), trained.nonzero().to(device)
