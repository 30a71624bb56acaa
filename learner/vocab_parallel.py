"""The embedding and the output layer split by vocabulary across the learner's FSDP2 ranks:
each rank holds its rows of the weight (a contiguous 1/world of the vocabulary, cut as
FSDP2 cuts a tensor: a DTensor sharded on dim 0 of the same mesh) and never gathers it.

At Qwen2.5's vocabulary (151,936 rows) the embedding is the model's largest tensor (28% of
0.5B's parameters); FSDP2 gathers it whole from the forward through the backward, and builds
its gradient whole before the reduce-scatter: three whole fp32 copies at once where a rank
holds half of one. Here the activations move instead of the weight (Megatron's
vocabulary-parallel layers, on data-parallel ranks: each rank has tokens of its own):

- embedding: every rank's token ids are all-gathered; each rank looks up the ones in its rows
  for every rank's tokens (zeros for the rest) and a reduce-scatter sums the pieces into each
  rank's own tokens' embeddings. Backward: the embeddings' gradients are all-gathered and each
  rank adds every rank's tokens' gradients into its rows.
- output layer: the hidden states of the scored positions are all-gathered; each rank scores
  its vocabulary slice for every rank's rows, in the chunks `learner.scoring` computes, and
  the pieces of each row's log-sum-exp are all-reduced (the max, then the rescaled sums): each
  rank keeps its own rows' log-probs and entropies. Backward: their gradients are all-reduced,
  each rank computes its slice's gradient for every row, and a reduce-scatter sums the hidden
  states' gradients back to their ranks.

What it costs per micro-batch: all-gathers and reduce-scatters of (tokens x hidden) and
(scored rows x hidden), and all-reduces of a few floats a row, instead of the (vocabulary x
hidden) weight gathered and its gradient reduce-scattered; the FLOPs are the same. Each
rank's gradient of its rows comes from every rank's tokens, added here into the parameter's
gradient in place (never a second copy of the rows), and divided by the ranks as FSDP2
averages the others'. Every rank must run each forward and
backward (the trainer's idle passes do). Collectives run on the weight's device (NCCL's
on CUDA), each tensor checked against it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from learner.distributed import chunk_rows


class VocabRows:
    """This rank's place in the vocabulary split of a DTensor `weight` (V, H) sharded on dim 0,
    and the collectives over its mesh's group."""

    def __init__(self, weight: DTensor):
        mesh = weight.device_mesh
        self.group, self.rank, self.world = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        self.device = weight.to_local().device
        self.lo, hi = chunk_rows(weight.shape[0], self.rank, self.world)
        self.rows = hi - self.lo

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_contiguous():  # a collective on a view would fill a copy of it
            raise ValueError("a vocabulary-parallel collective was handed a non-contiguous tensor")
        if t.device != self.device:  # an NCCL group has no CPU backend: never hand it a CPU tensor
            raise RuntimeError(f"a vocabulary-parallel collective was handed a tensor on {t.device}, "
                               f"its group's is {self.device}")
        return t

    def counts(self, n: int) -> list[int]:
        """Every rank's number of rows, in rank order."""
        mine = self._on_device(torch.tensor([n], dtype=torch.long, device=self.device))
        every = torch.empty(self.world, dtype=torch.long, device=self.device)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        return every.tolist()

    def gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's `x` (its counts[rank] rows), concatenated in rank order."""
        most = max(counts)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[:len(x)] = x
        out = x.new_empty((self.world * most, *x.shape[1:]))
        dist.all_gather_into_tensor(out, self._on_device(padded.contiguous()), group=self.group)
        return torch.cat([out[r * most:r * most + n] for r, n in enumerate(counts)])

    def scatter_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`x` (every rank's rows, in rank order) summed over the ranks; this rank's rows of the sum."""
        most = max(counts)
        padded = x.new_zeros((self.world * most, *x.shape[1:]))
        start = 0
        for r, n in enumerate(counts):
            padded[r * most:r * most + n] = x[start:start + n]
            start += n
        out = x.new_empty((most, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, self._on_device(padded), group=self.group)
        return out[:counts[self.rank]]

    def combine(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """`t` reduced over the ranks in place (all-reduce; a sum unless `op` says otherwise)."""
        dist.all_reduce(self._on_device(t), op=op, group=self.group)
        return t

    def mine(self, counts: list[int]) -> slice:
        """This rank's rows in a concatenation of every rank's."""
        start = sum(counts[:self.rank])
        return slice(start, start + counts[self.rank])

    def grad_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's rows of `param`'s gradient (a DTensor like it), made as zeros if it has none
        yet. Backward adds each part into it in place, so the rows are never held twice; its
        callers scale what they add by 1 / world (every rank's tokens reach these rows, and FSDP2
        averages the other parameters' gradients over the ranks)."""
        if param.grad is None:
            local = param.to_local()
            param.grad = DTensor.from_local(torch.zeros_like(local), param.device_mesh, param.placements,
                                            run_check=False, shape=param.shape, stride=param.stride())
        return param.grad.to_local()


class _GatherRows(torch.autograd.Function):
    """Every rank's rows, concatenated; backward: each rank's rows of the summed gradient."""

    @staticmethod
    def forward(ctx, x, vocab, counts):
        ctx.vocab, ctx.counts = vocab, counts
        return vocab.gather_rows(x, counts)

    @staticmethod
    def backward(ctx, grad):
        return ctx.vocab.scatter_rows(grad.contiguous(), ctx.counts), None, None


class _ScatterRows(torch.autograd.Function):
    """The sum over the ranks of every rank's rows, this rank's rows of it; backward: all-gathered."""

    @staticmethod
    def forward(ctx, x, vocab, counts):
        ctx.vocab, ctx.counts = vocab, counts
        return vocab.scatter_rows(x, counts)

    @staticmethod
    def backward(ctx, grad):
        return ctx.vocab.gather_rows(grad.contiguous(), ctx.counts), None, None


def gather_rows(x: torch.Tensor, vocab: VocabRows, counts: list[int]) -> torch.Tensor:
    """Every rank's rows of `x` (differentiable: the gradient goes back to the rank it came from)."""
    return _GatherRows.apply(x, vocab, counts)


class _Lookup(torch.autograd.Function):
    """Every rank's ids looked up in this rank's rows of the embedding (zeros for ids outside them);
    backward adds their gradients into the rows' gradient in place (`VocabRows.grad_of`)."""

    @staticmethod
    def forward(ctx, ids, param, vocab, padding_idx):
        inside = (ids >= 0) & (ids < vocab.rows)
        local = param.to_local()
        out = torch.nn.functional.embedding(ids.clamp(0, vocab.rows - 1), local) * inside[:, None].to(local.dtype)
        if padding_idx is not None:
            inside &= ids != padding_idx  # nn.Embedding's padding row gets no gradient
        ctx.save_for_backward(ids, inside)
        ctx.param, ctx.vocab = param, vocab
        return out

    @staticmethod
    def backward(ctx, grad):
        ids, inside = ctx.saved_tensors
        ctx.vocab.grad_of(ctx.param).index_add_(0, ids[inside], grad[inside].to(ctx.param.dtype),
                                                alpha=1.0 / ctx.vocab.world)
        return None, None, None, None


class VocabParallelEmbedding(torch.nn.Module):
    """nn.Embedding's place in a Hugging Face decoder, its weight a DTensor of this rank's rows."""

    def __init__(self, weight: torch.nn.Parameter, padding_idx: int | None = None):
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        vocab = VocabRows(self.weight)
        flat = ids.reshape(-1)
        counts = vocab.counts(len(flat))
        every = vocab.gather_rows(flat, counts) - vocab.lo  # every rank's ids, in this rank's rows' numbering
        pad = None if self.padding_idx is None else self.padding_idx - vocab.lo
        looked_up = _Lookup.apply(every, self.weight, vocab, pad)  # another rank's id: its part, not ours
        return _ScatterRows.apply(looked_up, vocab, counts).view(*ids.shape, -1)


def split_vocabulary(lm: torch.nn.Module, mesh) -> list[torch.nn.Parameter]:
    """Make `lm`'s input embedding and output layer vocabulary-parallel over `mesh` (1-D): their
    weights DTensors of this rank's rows (copied from a whole weight, or left empty when on the
    meta device or not yet filled: `load_shards` fills them), the embedding module replaced by a
    VocabParallelEmbedding, a tied output layer tied to the same parameter. Returns the new
    parameters (FSDP2 leaves them alone: `ignored_params`)."""
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight

    def split(p: torch.nn.Parameter) -> torch.nn.Parameter:
        if isinstance(p, DTensor):
            return p
        lo, hi = chunk_rows(p.shape[0], mesh.get_local_rank(), mesh.size())
        local = torch.empty((hi - lo, *p.shape[1:]), dtype=p.dtype, device=p.device) if p.is_meta \
            else p.detach()[lo:hi].clone()
        shard = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
        return torch.nn.Parameter(shard, requires_grad=p.requires_grad)

    weight = split(embed.weight)
    if not isinstance(embed, VocabParallelEmbedding):
        lm.set_input_embeddings(VocabParallelEmbedding(weight, embed.padding_idx))
    if head is not None:
        head.weight = weight if tied else split(head.weight)
    return [lm.get_input_embeddings().weight] + ([head.weight] if head is not None and not tied else [])
