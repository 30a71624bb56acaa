"""Run by tests/integration/test_distributed.py, alone or under torchrun: train the learner's
Trainer on fixed batches for steps [--first, --last], starting from a checkpoint or from the
model, and write a checkpoint after the last step (in the background, as the learner does,
while the weights are gathered for publishing on the training's own group)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from common.config import LearnerConfig
from learner.batch import collate
from learner.checkpoint import LearnerState, finish, read_model
from learner.distributed import setup
from learner.trainer import PREFIX, REFERENCE_DTYPE, Trainer
from tests.groups import sft_examples, varied_group

LEARNER = dict(max_tokens_per_microbatch=96, lr=3e-3, ppo_epochs=2, minibatches=2, entropy_coef=0.01)


def batches(steps: int, groups: int = 3):
    rng = np.random.default_rng(7)
    return [collate([varied_group(rng) for _ in range(groups)]) for _ in range(steps)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--parallel", default="ddp")
    p.add_argument("--first", type=int, default=1)
    p.add_argument("--last", type=int, required=True)
    p.add_argument("--resume", help="a checkpoint directory to start from")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--kl", type=float, default=0.0, help="learner.kl_coef: a frozen reference, loaded as the worker does")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--one-update", action="store_true", help="1 epoch x 1 minibatch: no proximal pass")
    p.add_argument("--sft", type=float, default=0.0, help="learner.sft_coef, on 5 episodes an update of 12 fixed ones")
    args = p.parse_args()
    # One update on micro-batches of a sample or two: ranks run unequal numbers of them (idle passes).
    learner = {**LEARNER, **(dict(ppo_epochs=1, minibatches=1, max_tokens_per_microbatch=60)
                             if args.one_update else {})}
    cfg = LearnerConfig(parallel=args.parallel, device="cpu", kl_coef=args.kl, precision=args.precision,
                        sft_coef=args.sft, sft_data=["fixed"], sft_episodes=5, **learner)
    parallel = setup(cfg.parallel, cfg.device, cfg.precision, cfg.vocab_parallel)
    torch.manual_seed(0)
    reference = parallel.load_model(args.model, REFERENCE_DTYPE[cfg.precision], trainable=False) if args.kl else None
    sft = sft_examples(np.random.default_rng(5), 12)
    trainer = Trainer(parallel.load_model(args.model), cfg, parallel, reference, sft)  # FSDP2: built sharded
    if reference is not None:
        kinds = {(type(p).__name__, str(p.dtype), p.requires_grad) for p in trainer.reference.parameters()}
        print(f"rank {parallel.rank} reference parameters {sorted(kinds)}", flush=True)
    embedding = trainer.model.get_input_embeddings().weight
    rows = tuple(embedding.to_local().shape) if hasattr(embedding, "to_local") else tuple(embedding.shape)
    print(f"rank {parallel.rank} embedding {type(embedding.data).__name__} rows {rows} of "
          f"{tuple(embedding.shape)}", flush=True)
    if args.resume:
        trainer.load_checkpoint(Path(args.resume))
    all_batches = batches(args.last)
    for step in range(args.first, args.last + 1):
        metrics = trainer.train_step(all_batches[step - 1])
        if parallel.is_main:
            print(f"step {step} microbatches {metrics['learner/microbatches']:.0f} clipped "
                  f"{metrics['learner/frac_clipped']:.3f} loss {metrics['learner/loss/policy']:.5f}"
                  + (f" sft {metrics['learner/loss/sft']:.5f}" if args.sft else ""), flush=True)
    # Every rank creates the directory (a rank may reach the save before rank 0 does), empty on a fresh --out.
    path = Path(args.out) / f"step-{args.last:08d}.tmp"
    path.mkdir(parents=True, exist_ok=True)
    written = trainer.save_checkpoint(path, background=True)
    # Published as the blob transport publishes: gathered and written a tensor at a time.
    trainer.save_weights(Path(args.out) / "published.safetensors", torch.bfloat16)
    written.result()  # this rank's shards; on rank 0 every rank's, and the metadata
    if parallel.is_main:
        published = load_file(Path(args.out) / "published.safetensors")
        saved = {k.removeprefix(PREFIX): v for k, v in read_model(finish(path, LearnerState(args.last, args.last),
                                                                          keep=1), PREFIX).items()}
        assert published.keys() == saved.keys(), (published.keys() ^ saved.keys())  # a tied layer: once in both
        assert all(torch.equal(published[k], v.to(torch.bfloat16)) for k, v in saved.items())
        print(f"published {len(published)} tensors, equal to the checkpoint's", flush=True)
    # Every rank leaves together: a rank tearing its gloo pairs down while rank 0 still writes aborted
    # once at exit ("terminate called without an active exception", exit -6) after both steps had run.
    if parallel.world > 1:
        torch.distributed.barrier()
    parallel.close()


if __name__ == "__main__":
    main()
