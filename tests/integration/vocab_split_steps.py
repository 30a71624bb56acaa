"""Run by tests/integration/test_distributed.py under torchrun (2 ranks): the scorer with the
embedding and output layer split by vocabulary (FSDP2, learner.vocab_parallel) against one
process scoring every rank's samples, on a model whose vocabulary does not divide by the ranks
and with unequal numbers of samples and scored rows on the ranks. Each rank checks its
log-probs and entropies, and every parameter's gradient (its rows of the split ones) against
the one process's, for a tied and an untied output layer; prints one line per model."""

from __future__ import annotations

import argparse

import torch

from common.models import load_causal_lm
from learner.distributed import setup
from learner.scoring import PolicyScorer

TOLERANCE = 1e-5


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    args = p.parse_args()
    parallel = setup("fsdp2", "cpu")
    for path in args.models:
        whole = PolicyScorer(load_causal_lm(path))
        vocab = whole.lm.config.vocab_size
        torch.manual_seed(0)
        tokens = torch.randint(0, vocab, (5, 9))
        tokens[4, 6:] = whole.lm.config.pad_token_id  # the padding row: no gradient, as nn.Embedding gives it
        owner = [0, 0, 0, 1, 1]  # rank 0 scores 3 samples, rank 1 two, of other lengths
        rows = torch.tensor([[n, t] for n in range(5) for t in range(1, 9 if owner[n] == 0 else 6)])
        temperature = torch.rand(len(rows)) + 0.5
        logp, entropy, _ = whole(tokens, torch.ones_like(tokens), rows, temperature)
        (logp.sum() + 0.3 * entropy.sum()).backward()

        split = parallel.wrap(PolicyScorer(parallel.load_model(path)))
        mine_samples = [n for n in range(5) if owner[n] == parallel.rank]
        mine = torch.tensor([i for i, (n, _t) in enumerate(rows.tolist()) if owner[n] == parallel.rank])
        local_rows = rows[mine].clone()
        local_rows[:, 0] -= mine_samples[0]
        logp2, entropy2, _ = split(tokens[mine_samples], torch.ones_like(tokens[mine_samples]), local_rows,
                                   temperature[mine])
        # FSDP2 averages gradients over the ranks: the trainer scales each rank's loss by the ranks.
        ((logp2.sum() + 0.3 * entropy2.sum()) * parallel.world).backward()
        worst = max(float((logp2 - logp[mine]).abs().max()), float((entropy2 - entropy[mine]).abs().max()))
        assert worst < TOLERANCE, f"{path}: log-probs or entropies off by {worst}"
        grads = dict(whole.named_parameters())
        kinds = set()
        for name, param in split.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            off = float((grad - grads[name].grad).abs().max())
            assert off < TOLERANCE, f"{path}: {name}'s gradient off by {off}"
            if "embed_tokens" in name or "lm_head" in name:
                kinds.add((name, tuple(param.to_local().shape), tuple(param.shape)))
        tied = whole.lm.config.tie_word_embeddings
        print(f"rank {parallel.rank} {'tied' if tied else 'untied'}: equal to one process; split {sorted(kinds)}",
              flush=True)
    torch.distributed.barrier()
    parallel.close()


if __name__ == "__main__":
    main()
