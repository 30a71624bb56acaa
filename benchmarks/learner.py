"""`omrl bench learner`: the learner's training step, `Trainer.train_step` at its defaults
(micro-batches of at most learner.max_tokens_per_microbatch tokens, log-probs and entropy
of the generated tokens chunked over the vocabulary, the off-policy loss, backward, grad
clip, AdamW) at one update per batch (`learner.minibatches = 1`: no proximal pass), against a
plain torch loop on its own copy of the model (one forward, a masked advantage-weighted
log-prob loss on the same generated tokens, backward, AdamW with the same lr; no proximal
pass, no entropy, no clip), alternated over repetitions on the same batches. A third copy,
`default`, runs `Trainer.train_step` at the config's defaults (the trust region: a proximal
pass over the batch, then `learner.minibatches` updates): its ratio to the one-update Trainer
is what the trust region costs a step.

Two Qwen2-architecture models with the 86-symbol character tokenizer, built here and loaded
through `load_causal_lm` (from_pretrained): the tiny model of `omrl init-model` and one of
about 100M parameters (hidden 768, 17 layers, 12 heads, MLP 1536); on CUDA also Qwen2.5-0.5B's
layers (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864: 0.36B parameters with this
vocabulary) and, on a GPU of 130 GiB or more, Qwen2.5-1.5B's (hidden 1536, 28 layers, 12 heads,
2 KV heads, MLP 8960: 1.3B parameters). Batches are collated once
by `learner.batch.collate` from synthetic rollout groups of G=8 samples whose lengths vary,
the second half of each sample generated, binary rewards that differ within every group, and
behaviour log-probs within about 0.05 of the model's own.

Figures per model: tokens/s (non-pad tokens per second of the step; the ratio is system /
baseline, repetition by repetition, so 1.0 means the Trainer costs nothing over the plain
loop), and peak step memory in MB: what the steps add above the memory held before them
(weights and AdamW state are held by both copies alike). On CPU that is the peak RSS, read by a
thread from /proc/self/statm every 2 ms, over the RSS before the repetition (freed heap given
back first with malloc_trim, gradients dropped); on CUDA `torch.cuda.max_memory_allocated`
after `reset_peak_memory_stats`, over `memory_allocated` before. Its ratio is baseline /
system, so above 1 the system uses less. The points also hold the median seconds of the
Trainer's named sections (learner/time/proximal, forward, backward, optimizer): where its step
goes (for `default`, the arm with a proximal pass). On CUDA, all compute under bf16 autocast
with fp32 weights, and MFU = 6 * params * tokens/s / the device's peak dense bf16 FLOP/s
(PEAK_FLOPS; the training FLOPs only: the default arm's proximal forward is work beyond them);
the sections are then host time, the Trainer's timer does not synchronize.
torch keeps its default intra-op threads (all cores; `omrl run`'s learner uses
learner.threads, 1 by default)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import os
import statistics
import tempfile
import threading
import time

import numpy as np

from benchmarks.common import alternate, pyplot, ratios, row, spread

G = 8  # samples per rollout group
MODELS = {"tiny": {}, "100M": {"hidden": 768, "layers": 17, "heads": 12}}  # init_tiny_model's arguments
# On CUDA only: Qwen2.5-0.5B's and 1.5B's bodies (their layers, widths and grouped KV heads) on the
# character vocabulary, each where the GPU has the memory (GiB) its three copies and steps need.
CUDA_MODELS = {"0.5B-body": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864},
               "1.5B-body": {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960}}
GPU_GB_NEEDED = {"0.5B-body": 40, "1.5B-body": 130}
SECTIONS = ("proximal", "forward", "backward", "optimizer")
# Peak dense bf16 FLOP/s by device name, first match wins (NVIDIA data sheets, no sparsity).
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12),
              ("L40", 181e12), ("A10G", 70e12), ("L4", 121e12))


@dataclasses.dataclass(frozen=True)
class Shape:
    groups: int  # rollout groups of G samples per batch
    max_len: int  # longest sample; lengths are uniform in [max_len / 2, max_len]
    batches: int  # distinct batches, each one step of every repetition
    min_len: int | None = None  # shortest sample (default max_len / 2)


SHAPES = {"cpu": {"tiny": Shape(8, 256, 2), "100M": Shape(1, 192, 2)},
          "cuda": {"tiny": Shape(8, 512, 8), "100M": Shape(8, 512, 8), "0.5B-body": Shape(8, 512, 8),
                   "1.5B-body": Shape(4, 512, 8)}}  # half the batch: the plain loop holds it whole
QUICK_SHAPE = Shape(1, 64, 2)


def make_groups(rng: np.random.Generator, shape: Shape, vocab: int) -> list:
    """Rollout groups of G samples: a prompt, then generated tokens (loss_mask 1) for the
    second half; rewards 0/1 with both in every group, so every group has signal."""
    from common.messages import RolloutGroup, Sample

    groups = []
    for g in range(shape.groups):
        rewards = rng.integers(0, 2, G).astype(np.float32)
        rewards[:2] = (1.0, 0.0)
        samples = []
        for reward in rewards:
            n = int(rng.integers(shape.min_len or shape.max_len // 2, shape.max_len + 1))
            mask = (np.arange(n) >= n // 2).astype(np.uint8)
            samples.append(Sample(tokens=rng.integers(0, vocab, n).astype(np.int32), loss_mask=mask,
                                  logprobs=np.zeros(n, np.float32), versions=np.where(mask, 0, -1).astype(np.int32),
                                  reward=float(reward), turn_rewards=np.array([reward], np.float32), num_turns=1,
                                  finish_reason="stop", task_id=str(g), env_name="bench"))
        groups.append(RolloutGroup(task_id=str(g), env_name="bench", actor_id="bench", sampling={}, samples=samples))
    return groups


def to_device(batch, device):
    """The Batch with its tensor fields on `device` (collate builds them on the CPU)."""
    import torch

    moved = {f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **moved)


def plain_logprobs(model, batch):
    """(N, T-1) log-prob of each next token from the full (N, T, V) logits: the plain way."""
    import torch

    logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits  # (N, T, V)
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, batch.tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def with_behaviour(batch, model, rng: np.random.Generator):
    """The Batch with behaviour log-probs near the model's: its own log-prob of each generated
    token plus noise of std 0.05, as an actor a version or two behind would give."""
    import torch

    with torch.no_grad():
        own = torch.nn.functional.pad(plain_logprobs(model, to_device(batch, model.device)), (1, 0)).cpu()
    noise = torch.from_numpy(rng.normal(0.0, 0.05, own.shape).astype(np.float32))
    return dataclasses.replace(batch, behav_logprobs=(own + noise) * batch.generated_mask)  # (N, T)


def baseline_step(model, optimizer, batch, autocast) -> None:
    """One plain step: -mean over generated tokens of advantage * log-prob, backward, AdamW."""
    with autocast():
        logp = plain_logprobs(model, batch)
    mask = batch.loss_mask[:, 1:]  # (N, T-1)
    loss = -(logp * batch.advantages[:, 1:] * mask).sum() / mask.sum().clamp(min=1.0)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Peak resident memory of this process while open, over what it was on entry: a thread
    reads /proc/self/statm every 2 ms (torch releases the GIL in its kernels). `trim`: hand
    glibc's freed heap back first (else what the process kept from before counts as held)."""

    trim = True

    def __enter__(self) -> PeakRss:
        gc.collect()
        if self.trim:
            with contextlib.suppress(OSError, AttributeError):  # glibc keeps freed heap without it
                ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.before = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.increase = self.peak - self.before


class PeakCuda:
    """Peak CUDA memory allocated while open, over what was allocated on entry."""

    def __enter__(self) -> PeakCuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
        self.before = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.synchronize()
        self.increase = torch.cuda.max_memory_allocated() - self.before


def peak_flops(device: str) -> float | None:
    """Peak dense bf16 FLOP/s of the GPU, None on CPU or for a GPU not in PEAK_FLOPS."""
    import torch

    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_FLOPS if key in name), None)


def measure_model(label: str, model_dir, shape: Shape, device: str, repeats: int) -> dict:
    """Warm-up, then `repeats` alternated repetitions of the three arms, each one step
    per batch: the point for this model."""
    import torch

    from common.config import LearnerConfig
    from common.models import load_causal_lm
    from learner.batch import collate
    from learner.trainer import Trainer

    dev = torch.device(device)
    # All three keep fp32 weights and AdamW state; on CUDA all compute under bf16 autocast.
    cfg = LearnerConfig(device=device, precision="bf16" if device == "cuda" else "fp32")
    trainer = Trainer(load_causal_lm(str(model_dir), "float32"), LearnerConfig(**{**cfg.model_dump(), "minibatches": 1}))
    default = Trainer(load_causal_lm(str(model_dir), "float32"), cfg)  # the trust region: proximal pass, minibatches
    plain = load_causal_lm(str(model_dir), "float32").to(dev).train()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    autocast = lambda: torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")  # noqa: E731
    rng = np.random.default_rng(0)
    vocab = plain.config.vocab_size - 1  # every symbol but the end-of-text token
    # The Trainer takes batches on the CPU (it moves each micro-batch); the plain loop on the device.
    batches = [with_behaviour(collate(make_groups(rng, shape, vocab)), plain, rng) for _ in range(shape.batches)]
    on_device = [to_device(b, dev) for b in batches]
    tokens = sum(int(b.attention_mask.sum()) for b in batches)  # non-pad tokens per repetition
    meter = PeakCuda if device == "cuda" else PeakRss
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None  # before every clock read
    memory: dict[str, list[float]] = {"system": [], "baseline": [], "default": []}
    sections: dict[str, list[float]] = {name: [] for name in SECTIONS}

    def repetition(kind: str, model, batches, step) -> float:
        model.zero_grad(set_to_none=True)  # both start without gradients (both free them after each step)
        with meter() as peak:
            sync()
            started = time.perf_counter()
            for batch in batches:
                step(batch)
            sync()
            elapsed = time.perf_counter() - started
        memory[kind].append(max(peak.increase, 4096) / 1e6)  # a page at least: a ratio needs no zero
        return tokens / elapsed

    def default_step(batch) -> None:
        metrics = default.train_step(batch)
        for name in SECTIONS:
            sections[name].append(metrics.get(f"learner/time/{name}_s", 0.0))  # optimizer: absent on a skipped step

    trainer.train_step(batches[0])  # warm-up: allocator, AdamW state, kernels
    default.train_step(batches[0])
    baseline_step(plain, optimizer, on_device[0], autocast)
    runs = alternate({"system": lambda: repetition("system", trainer.model, batches, trainer.train_step),
                      "baseline": lambda: repetition("baseline", plain, on_device,
                                                     lambda b: baseline_step(plain, optimizer, b, autocast)),
                      "default": lambda: repetition("default", default.model, batches, default_step)},
                     repeats)
    skipped = trainer.skipped_nonfinite + default.skipped_nonfinite
    return summarize(label, shape, batches, plain, runs, memory, sections, skipped, device, cfg.minibatches)


def summarize(label, shape, batches, model, runs, memory, sections, skipped, device, minibatches) -> dict:
    params = sum(p.numel() for p in model.parameters())
    flops = peak_flops(device)
    mfu = {k: 6 * params * statistics.median(v) / flops if flops else None for k, v in runs.items()}
    c = model.config
    point = {"model": label, "params": params, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
             "shape": {"hidden": c.hidden_size, "layers": c.num_hidden_layers, "heads": c.num_attention_heads,
                       "intermediate": c.intermediate_size, "vocab": c.vocab_size},
             "batch": {"groups": shape.groups, "samples": shape.groups * G, "max_len": shape.max_len,
                       "batches": shape.batches, "padded_T": [int(b.tokens.shape[1]) for b in batches],
                       "tokens": [int(b.attention_mask.sum()) for b in batches],
                       "trained_tokens": [b.num_trained_tokens for b in batches]},
             "tokens_per_s": {k: spread(v) for k, v in runs.items()},
             "ratio_tokens_per_s": ratios(runs["system"], runs["baseline"]),
             "default_minibatches": minibatches,
             "ratio_default_tokens_per_s": ratios(runs["default"], runs["system"]),
             "peak_mb": {k: spread(v) for k, v in memory.items()},
             "ratio_peak_mb": ratios(memory["baseline"], memory["system"]),
             "default_time_s": {name: statistics.median(v) for name, v in sections.items()},
             "mfu": mfu, "peak_flops": flops, "skipped_nonfinite": skipped, "runs": runs, "memory_runs": memory}
    report(point)
    return point


def report(p: dict) -> None:
    """One progress line per model."""
    figures = {k: f"system {p[k]['system']['median']:.0f}, plain {p[k]['baseline']['median']:.0f}, "
                  f"default {p[k]['default']['median']:.0f}" for k in ("tokens_per_s", "peak_mb")}
    split = ", ".join(f"{k} {v:.3f}" for k, v in p["default_time_s"].items())
    mfu = "".join(f", MFU {k} {v:.1%}" for k, v in p["mfu"].items() if v is not None)
    print(f"learner {p['model']:>4} ({p['params'] / 1e6:.1f}M params): tokens/s {figures['tokens_per_s']}; "
          f"peak MB {figures['peak_mb']}; default step s: {split}{mfu}", flush=True)


def run(quick: bool, device: str = "cpu") -> dict:
    import torch

    from common.models import init_tiny_model

    models = {"tiny": MODELS["tiny"]} if quick else {**MODELS, **(CUDA_MODELS if device == "cuda" else {})}
    if device == "cuda":
        gpu_gb = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
        for label in [m for m in models if GPU_GB_NEEDED.get(m, 0) > gpu_gb]:
            print(f"learner {label}: skipped, needs {GPU_GB_NEEDED[label]} GiB of GPU memory, this GPU has {gpu_gb:.0f}",
                  flush=True)
            del models[label]
    points = []
    with tempfile.TemporaryDirectory(prefix="omrl-bench-learner-") as tmp:
        for label, arguments in models.items():
            model_dir = init_tiny_model(os.path.join(tmp, label), **arguments)
            shape = QUICK_SHAPE if quick else SHAPES[device][label]
            points.append(measure_model(label, model_dir, shape, device, repeats=1 if quick else 3))
    rows = []
    for p in points:
        name = f"{p['model']} ({p['params'] / 1e6:.1f}M params)"
        rows.append(row(f"{name}: tokens/s of the training step", p["runs"]["system"], p["runs"]["baseline"]))
        rows.append({"measure": f"{name}: peak step MB (lower is better; ratio is baseline / system)",
                     "system": p["peak_mb"]["system"]["median"], "baseline": p["peak_mb"]["baseline"]["median"],
                     "ratio": p["ratio_peak_mb"]})
        rows.append(row(f"{name}: tokens/s of the default trust region ({p['default_minibatches']} updates a batch after a "
                        "proximal pass) over one update", p["runs"]["default"], p["runs"]["system"]))
    return {"points": points, "rows": rows, "threads": torch.get_num_threads()}


def plot(result: dict, path) -> None:
    plt = pyplot()
    points = result["points"]
    mosaic = [[f"{key} {p['model']}" for p in points] + ["split"] for key in ("tokens_per_s", "peak_mb")]
    fig, axes = plt.subplot_mosaic(mosaic, figsize=(3.2 * len(points) + 6, 6.5), width_ratios=[1] * len(points) + [2])
    for p in points:
        for key, title in (("tokens_per_s", "tokens/s (higher is better)"),
                           ("peak_mb", "peak step MB (lower is better)")):
            ax = axes[f"{key} {p['model']}"]
            values = [p[key][kind]["median"] for kind in ("system", "baseline", "default")]
            bars = ax.bar(["Trainer,\n1 update", "plain loop", "Trainer,\ndefault"], values, color=["C0", "C1", "C2"])
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
            ax.set_title(f"{p['model']}: {title}", fontsize=9)
            ax.grid(alpha=0.3, axis="y")
    plot_split(axes["split"], points)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_split(ax, points: list[dict]) -> None:
    """Stacked bars: each section's share of the Trainer's step, labelled with its seconds."""
    y, left = np.arange(len(points)), np.zeros(len(points))
    for name in SECTIONS:
        seconds = np.array([p["default_time_s"][name] for p in points])
        share = 100 * seconds / np.maximum([sum(p["default_time_s"].values()) for p in points], 1e-12)
        ax.barh(y, share, left=left, label=name)
        for i, (s, w) in enumerate(zip(seconds, share)):
            if w > 8:
                ax.text(left[i] + w / 2, i, f"{s:.2f}s", ha="center", va="center", fontsize=8)
        left += share
    ax.set_yticks(y, [p["model"] for p in points])
    ax.set_xlabel("% of the default Trainer's step (labels: median seconds per step)")
    ax.set_title("where the Trainer's step goes", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=4)
