"""`omrl bench memory`: the learner's peak memory in a training step is set by
`learner.max_tokens_per_microbatch`, not by the batch.

The model is a Qwen2-architecture causal LM built here (random weights, saved and loaded
with from_pretrained) with Qwen2.5's vocabulary size, 151,936, tied embeddings, hidden
768 and 12 layers: about 200M parameters, 117M of them the embedding. At that vocabulary
the full fp32 logits of 64 sequences of 2048 tokens take 80 GB; the learner computes only
the generated tokens' rows, in chunks (`learner/scoring.py`).

One `Trainer.train_step` per point on 64 sequences and on 16 (the baseline) of the same
length, half of each sample generated, at each micro-batch budget, at one update per batch
(`learner.minibatches = 1`: with the default four, a minibatch of the 16 sequences holds 8,192
tokens, below the larger budgets, and the comparison would be of two budgets); the ratio is baseline /
system, so about 1.0 means four times the batch costs no more memory. Peak memory is what
the step adds over the memory held before it (weights, AdamW state): on CUDA
`max_memory_allocated` after `reset_peak_memory_stats`, on CPU the peak RSS (as in
`omrl bench learner`). On CUDA the step runs in bf16 autocast over fp32 weights, sequences
of 2048 tokens; on CPU in fp32 over shorter sequences (a full-size step takes many minutes
on two cores), with the same model.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from benchmarks.common import pyplot, spread
from benchmarks.learner import G, PeakCuda, PeakRss, Shape, make_groups

MODEL = {"hidden": 768, "layers": 12, "heads": 12, "vocab_size": 151_936, "tie_word_embeddings": True}
SEQUENCES = (16, 64)  # baseline, system
SETUPS = {  # device -> sequence length, (micro-batch budget, gradient checkpointing) points
    "cuda": (2048, ((8192, False), (32768, False), (32768, True))),
    "cpu": (256, ((1024, False), (4096, False))),
}
QUICK = {"model": {"hidden": 64, "layers": 2, "heads": 2, "vocab_size": 4096, "tie_word_embeddings": True},
         "length": 64, "points": ((256, False),)}


def build_model(path: str, hidden: int, layers: int, heads: int, vocab_size: int, tie_word_embeddings: bool) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                         tie_word_embeddings=tie_word_embeddings, max_position_embeddings=4096)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def measure(model_dir: str, device: str, length: int, budget: int, checkpointing: bool) -> dict:
    """Peak memory of one step per batch size (after a warm-up step that allocates AdamW state)."""
    import torch

    from common.config import LearnerConfig
    from common.models import load_causal_lm
    from learner.batch import collate
    from learner.trainer import Trainer

    cfg = LearnerConfig(device=device, precision="bf16" if device == "cuda" else "fp32",
                        max_tokens_per_microbatch=budget, gradient_checkpointing=checkpointing, minibatches=1)
    trainer = Trainer(load_causal_lm(model_dir, "float32"), cfg)
    rng = np.random.default_rng(0)
    vocab = trainer.model.config.vocab_size
    batches = {n: collate(make_groups(rng, Shape(n // G, length, 1, min_len=length), vocab)) for n in SEQUENCES}
    for b in batches.values():  # behaviour log-probs near the model's (uniform-ish at random init)
        b.behav_logprobs = -float(np.log(vocab)) * b.generated_mask
    trainer.train_step(batches[SEQUENCES[0]])  # warm-up
    meter = PeakCuda if device == "cuda" else PeakRss
    point = {"budget": budget, "checkpointing": checkpointing, "length": length, "peak_gb": {}, "step_s": {},
             "microbatches": {}}
    for n, batch in batches.items():
        with meter() as peak:
            started = time.perf_counter()
            metrics = trainer.train_step(batch)
            if device == "cuda":
                torch.cuda.synchronize()
        point["peak_gb"][n], point["step_s"][n] = peak.increase / 1e9, time.perf_counter() - started
        point["microbatches"][n] = metrics["learner/microbatches"]
    held = sum(p.numel() * 4 * 3 for p in trainer.model.parameters()) / 1e9  # weights + AdamW's two moments
    point["held_gb"] = held
    print(f"memory: budget {budget} tokens{' + checkpointing' if checkpointing else ''}: "
          + ", ".join(f"{n} x {length} tokens: peak +{point['peak_gb'][n]:.2f} GB in {point['step_s'][n]:.1f}s "
                      f"({point['microbatches'][n]:.0f} micro-batches)" for n in SEQUENCES)
          + f"; weights and AdamW hold {held:.2f} GB", flush=True)
    del trainer
    return point


def run(quick: bool, device: str = "cpu") -> dict:
    spec = QUICK["model"] if quick else MODEL
    length, points = (QUICK["length"], QUICK["points"]) if quick else SETUPS[device]
    with tempfile.TemporaryDirectory(prefix="omrl-bench-memory-") as tmp:
        model_dir = build_model(os.path.join(tmp, "model"), **spec)
        measured = [measure(model_dir, device, length, budget, ckpt) for budget, ckpt in points]
    rows = []
    full_logits_gb = SEQUENCES[1] * length * spec["vocab_size"] * 4 / 1e9
    for p in measured:
        base, system = p["peak_gb"][SEQUENCES[0]], p["peak_gb"][SEQUENCES[1]]
        rows.append({"measure": f"learner peak step GB, {SEQUENCES[1]} vs {SEQUENCES[0]} sequences of {length} tokens, "
                                f"micro-batch budget {p['budget']}{' + checkpointing' if p['checkpointing'] else ''} "
                                f"(ratio {SEQUENCES[0]}/{SEQUENCES[1]}: 1.0 = the batch adds nothing)",
                     "system": system, "baseline": base, "ratio": spread([base / max(system, 1e-9)])})
    return {"points": measured, "rows": rows, "model": spec, "full_logits_gb": full_logits_gb}


def plot(result: dict, path) -> None:
    plt = pyplot()
    points = result["points"]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{p['budget']}{' +ckpt' if p['checkpointing'] else ''}" for p in points]
    x = np.arange(len(points))
    for i, n in enumerate(SEQUENCES):
        bars = ax.bar(x + (i - 0.5) * 0.4, [p["peak_gb"][n] for p in points], 0.4,
                      label=f"{n} sequences of {points[0]['length']} tokens")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(x, labels)
    ax.set_xlabel("learner.max_tokens_per_microbatch")
    ax.set_ylabel("peak GB added by the step")
    ax.set_title(f"Learner step memory follows the micro-batch budget (full logits would be "
                 f"{result['full_logits_gb']:.0f} GB)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
