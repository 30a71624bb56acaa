"""Will it fit? The per-GPU memory of the learner and of the actors' vLLM engines, from the
config and the model's config.json alone (no torch, no model loaded): `omrl plan`.

Estimates, not measurements. The learner's state is exact arithmetic (bytes a parameter); its
step memory counts the tensors a Qwen2-style decoder layer saves for backward, checked against
the one measured GPU point (one H100, `omrl bench memory`: a 220M Qwen2, hidden 768, 12 layers,
Qwen2.5's vocabulary, bf16 autocast; docs/results/learner.md). What one step added, measured
and estimated by `step_added` (the gradients included where there were several micro-batches):

    tokens a micro-batch   checkpointing   measured   estimate   error
    8,192                  off             7.18 GB    7.36 GB    +2.5%
    32,768                 off             20.8 GB    22.1 GB    +6.3%
    32,768                 on              3.69 GB    3.59 GB    -2.8%

(tests/unit/test_plan.py holds each within 15%, a tolerance chosen before the comparison.)

The formula, per micro-batch of T tokens (h hidden, I the MLP's width, L layers, e the compute
bytes: 2 under bf16 autocast, 4 in fp32), one decoder layer saves a token's
    16h                      both RMSNorms' fp32 input and normalised input (the residual is fp32)
  + e x (n x h)              the norms' outputs as the linears take them: under autocast each of
                             q, k, v, gate and up casts its own copy (n = 5), in fp32 one each (n = 2)
  + e x 5h                   q, k and v after RoPE with k and v repeated over the heads (HF's SDPA
                             path with a padding mask), the attention output and its contiguous copy
  + e x 4I                   gate, SiLU(gate), up and their product
so 36h + 8I bytes under bf16 and 44h + 16I in fp32. Without gradient checkpointing a micro-batch
keeps that for L layers; with it, every layer's fp32 input (4h), and in backward one layer's
worth (the peak is the larger of the forward's end and the backward: `step_terms`).
On top: the final norm (8h a token), the output layer's rows (fp32 inputs and their gradients,
8h a generated token), its gradient made whole in its backward (4 x vocabulary x h; under FSDP2
with learner.vocab_parallel none: each rank adds into its rows' gradient, and the exchanged
embeddings, rows and gradients of every rank's tokens take 16h a token a rank instead), its chunk
buffers (about 18 bytes x min(generated, ROW_CHUNK) x learner.vocab_chunk), and under bf16 the
copies of the decoder layers' weights autocast makes (2 bytes a parameter; FSDP2 gathers them
in bf16 instead, with its own unsharded buffers).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.config import Config, count_parameters
from common.gpus import evaluator_gpus

GB = 1e9
ROW_CHUNK = 4096  # learner/scoring.py's ROW_CHUNK (importing it would import torch; a test keeps them equal)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CALIBRATION_TOLERANCE = 0.15  # chosen before the estimate was compared with the measured points


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a decoder-only model's config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    parameters: int

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelShape:
        parameters = count_parameters(hf)
        if parameters == 0:
            raise ValueError("config.json lacks hidden_size, num_hidden_layers or vocab_size: not a decoder-only LM")
        h = int(hf["hidden_size"])
        heads = int(hf.get("num_attention_heads") or 1)
        return cls(hidden=h, layers=int(hf["num_hidden_layers"]), heads=heads,
                   kv_heads=int(hf.get("num_key_value_heads") or heads),
                   head_dim=int(hf.get("head_dim") or h // heads), intermediate=int(hf.get("intermediate_size") or 4 * h),
                   vocab=int(hf["vocab_size"]), tied=bool(hf.get("tie_word_embeddings")), parameters=parameters)

    @property
    def root_parameters(self) -> int:
        """The embedding and the output layer (FSDP2's root unit)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def layer_parameters(self) -> int:
        """One decoder layer's."""
        return (self.parameters - self.root_parameters) // self.layers

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def read_model(path: str | Path) -> tuple[ModelShape, dict[str, Any]]:
    """The shape of the model in directory `path` (its config.json), and the config itself."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: pass --model DIR, a local model directory with config.json "
                                f"(for a hub id, download it first: huggingface-cli download ID --local-dir DIR)")
    hf = json.loads(file.read_text())
    return ModelShape.from_hf(hf), hf


def layer_bytes_per_token(m: ModelShape, precision: str) -> int:
    """What one decoder layer saves for backward, a token (the module docstring lists the tensors)."""
    e, casts = (2, 5) if precision == "bf16" else (4, 2)
    return 16 * m.hidden + e * (casts * m.hidden + 5 * m.hidden + 4 * m.intermediate)


def step_terms(m: ModelShape, precision: str, checkpointing: bool, tokens: int, generated: int, vocab_chunk: int,
               weight_copies: bool = True, whole_output_gradient: bool = True) -> dict[str, int]:
    """Bytes one micro-batch of `tokens` tokens (`generated` of them scored) adds at its peak on a
    rank that runs the whole model, by what holds them. `weight_copies`: autocast's bf16 copies of
    the decoder layers' weights (not under FSDP2, which gathers them in bf16 itself).
    `whole_output_gradient`: the output layer's gradient made whole in its backward (not when
    split by vocabulary, learner.vocab_parallel: added into the sharded gradient in place). Without
    checkpointing everything is held at the start of backward; with it, the peak is the larger of
    the forward's end (the weight copies are autocast's cache until the forward ends) and the
    backward (the output layer's gradient, then one layer recomputed at a time)."""
    h, per_layer = m.hidden, layer_bytes_per_token(m, precision)
    rows = 8 * h * generated + 18 * min(generated, ROW_CHUNK) * min(vocab_chunk, m.vocab)  # inputs, grads, chunks
    gradient = 4 * m.vocab * h if whole_output_gradient else 0  # the output layer's, made whole in its backward
    copies = 2 * m.layer_parameters * m.layers if precision == "bf16" and weight_copies else 0
    final = 8 * h * tokens  # the final norm's input and normalised input (then the gradient in flight)
    if not checkpointing:
        out = {"activations": m.layers * per_layer * tokens + final, "output layer": gradient + rows,
               "autocast bf16 weight copies": copies}
    else:
        held = {"layer inputs (checkpointed)": m.layers * 4 * h * tokens, "final norm": final}
        forward = {**held, "output layer's rows (forward)": rows, "autocast bf16 weight copies": copies}
        recompute = per_layer * tokens
        backward = {**held, "output layer (backward)": gradient + max(rows - recompute, 0),
                    "one layer recomputed": recompute}
        out = max(forward, backward, key=lambda d: sum(d.values()))
    return {k: v for k, v in out.items() if v}


def step_added(m: ModelShape, precision: str, checkpointing: bool, tokens: int, generated: int, vocab_chunk: int,
               microbatches: int) -> int:
    """What `omrl bench memory` measures: a step's peak over the memory held before it (weights and
    AdamW), one rank. The gradients (4 bytes a parameter) count where several micro-batches
    accumulate into them; with one, the output layer's gradient is all there is at the peak."""
    grads = 4 * m.parameters if microbatches > 1 else 0
    return grads + sum(step_terms(m, precision, checkpointing, tokens, generated, vocab_chunk).values())


@dataclass
class Part:
    """One component's verdict: its lines (name -> bytes), what it has, and what to change."""

    lines: dict[str, int]
    available: int | None  # None: not checked (host memory)
    status: str = "fits"  # fits, tight (works, with less than the worst case), does not fit
    notes: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.lines.values())


@dataclass
class Plan:
    model: dict[str, Any]
    gpus: int
    gpu_memory_gb: float
    placement: list[str]
    learner: Part
    actors: Part

    @property
    def fits(self) -> bool:
        return self.learner.status != "does not fit" and self.actors.status != "does not fit"

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("learner", "actors"):
            out[name]["total"] = getattr(self, name).total
        out["fits"] = self.fits
        return out


def learner_lines(cfg: Config, m: ModelShape, tokens: int | None = None, parallel: str | None = None,
                  ranks: int | None = None, checkpointing: bool | None = None, kl: bool | None = None) -> dict[str, int]:
    """The learner's bytes on one rank (rank 0, the largest), by what holds them; arguments override the config's."""
    lc = cfg.learner
    parallel, ranks = parallel or lc.parallel, ranks or lc.ranks
    checkpointing = lc.gradient_checkpointing if checkpointing is None else checkpointing
    kl = lc.kl_coef > 0 if kl is None else kl
    tokens = max(tokens or lc.max_tokens_per_microbatch, cfg.actor.max_seq_len)  # a longer sequence goes alone
    sharded = parallel == "fsdp2" and ranks > 1
    share = ranks if sharded else 1
    P = m.parameters
    lines = {"weights (fp32)": math.ceil(4 * P / share), "gradients (fp32)": math.ceil(4 * P / share),
             "AdamW moments (fp32)": math.ceil(8 * P / share)}
    ref_bytes = 2 if lc.precision == "bf16" else 4  # the reference is kept in the compute's precision
    if kl:
        where = "sharded" if sharded else "whole on every rank"
        lines[f"KL reference ({'bf16' if ref_bytes == 2 else 'fp32'}, {where})"] = math.ceil(ref_bytes * P / share)
    if parallel == "ddp" and ranks > 1:
        lines["DDP gradient buckets (fp32)"] = 4 * P
    split = sharded and lc.vocab_parallel  # the embedding and output layer split by vocabulary, never gathered
    lines.update(step_terms(m, lc.precision, checkpointing, tokens, tokens, lc.vocab_chunk, weight_copies=not sharded,
                            whole_output_gradient=not split))
    if sharded:  # the root unit (embeddings, output layer unless split) stays gathered through the step; two layers
        e = 2 if lc.precision == "bf16" else 4  # gathered in bf16 under bf16 (MixedPrecisionPolicy)
        reduce = 4 if e == 2 else 0  # gradients cast to fp32 for the reduce-scatter
        lines["FSDP2 gathered parameters and gradients"] = ((0 if split else m.root_parameters) * (2 * e + reduce)
                                                            + m.layer_parameters * (3 * e + reduce))
    if split:  # every rank's tokens looked up and scored here: their embeddings, hidden rows and gradients (fp32)
        lines["vocabulary-parallel exchange (every rank's tokens)"] = 4 * 4 * m.hidden * tokens * ranks
    return lines


def _plan_learner(cfg: Config, m: ModelShape, available: int | None, gpus: int) -> Part:
    lc = cfg.learner
    part = Part(learner_lines(cfg, m), available)
    if available is None:
        part.notes.append("on the CPU: host memory, not checked")
        return part
    if part.total <= available:
        return part
    part.status = "does not fit"

    def fits(**kw) -> bool:
        return sum(learner_lines(cfg, m, **kw).values()) <= available

    if lc.kl_coef > 0 and fits(kl=False):
        saved = sum(learner_lines(cfg, m).values()) - sum(learner_lines(cfg, m, kl=False).values())
        part.fixes.append(f"set learner.kl_coef = 0 (saves {saved / GB:.1f} GB a rank)")
    if not lc.gradient_checkpointing and fits(checkpointing=True):
        part.fixes.append("turn on learner.gradient_checkpointing")
    smaller = [t for t in range(lc.max_tokens_per_microbatch - 1024, 1023, -1024) if fits(tokens=t)]
    if smaller and smaller[0] >= cfg.actor.max_seq_len:
        part.fixes.append(f"lower learner.max_tokens_per_microbatch to {smaller[0]}")
    for ranks in range(max(2, lc.ranks), 65):
        if fits(parallel="fsdp2", ranks=ranks):
            part.fixes.append(f'use learner.parallel = "fsdp2" with learner.ranks = {ranks} (a GPU each; '
                              f'--gpus {gpus} now)')
            break
    part.fixes.append("a smaller model")
    return part


def _plan_actors(cfg: Config, m: ModelShape, share: float | None, gpu_bytes: int | None) -> Part:
    """One actor's engine, per GPU it uses; `share` is its fraction of the GPU (None: the CPU)."""
    ac = cfg.actor
    tp = ac.tensor_parallel_size
    dtype = DTYPE_BYTES[cfg.model.dtype]
    weights = math.ceil(m.parameters * dtype / tp)
    per_token = m.kv_bytes_per_token(dtype) / tp
    episodes = ac.concurrent_groups * ac.group_size
    need_tokens = episodes * ac.max_seq_len
    context = ac.max_model_len or ac.max_seq_len
    part = Part({"weights": weights, "KV cache needed": math.ceil(need_tokens * per_token)}, None)
    if ac.kv_cache_mb is not None or gpu_bytes is None:
        kv = (ac.kv_cache_mb or 64) * 1024 * 1024
        part.notes.append(f"KV cache: actor.kv_cache_mb = {kv // 2**20} MiB"
                          + ("" if ac.kv_cache_mb is not None else " (the CPU's default)"))
        engine = None if gpu_bytes is None else int(share * gpu_bytes)
    else:
        engine = int(share * gpu_bytes)
        kv = engine - weights
        part.notes.append(f"engine share: actor.gpu_memory_utilization = {ac.gpu_memory_utilization} of "
                          f"{gpu_bytes / GB:.0f} GB = {engine / GB:.1f} GB, its activations and CUDA graphs included")
    part.available = kv
    have_tokens = max(0, int(kv // per_token))
    part.notes.append(f"KV cache: {per_token / 1024:.0f} KiB a token; {episodes} episodes "
                      f"({ac.concurrent_groups} x {ac.group_size}) x {ac.max_seq_len} tokens = {need_tokens:,} tokens "
                      f"needed at most, {have_tokens:,} held")
    if engine is not None and weights >= engine:
        part.status = "does not fit"
        part.fixes += [f"raise actor.gpu_memory_utilization above {weights / gpu_bytes:.2f}",
                       "raise actor.tensor_parallel_size", "a smaller model"]
        return part
    if have_tokens >= need_tokens:
        return part
    part.status = "tight" if have_tokens >= context else "does not fit"
    if part.status == "tight":
        part.notes.append("vLLM preempts (and recomputes) episodes when all of them are long at once")
    else:
        part.notes.append(f"vLLM refuses to start: its KV cache must hold one {context}-token sequence")
    groups = have_tokens // (ac.group_size * ac.max_seq_len)
    if groups >= 1:
        part.fixes.append(f"lower actor.concurrent_groups to {groups}")
    if ac.kv_cache_mb is not None or gpu_bytes is None:
        part.fixes.append(f"raise actor.kv_cache_mb to {math.ceil(need_tokens * per_token / 2**20)}")
    else:
        util = (weights + need_tokens * per_token) / gpu_bytes
        if util <= 1:
            part.fixes.append(f"raise actor.gpu_memory_utilization to {math.ceil(util * 100) / 100:.2f}")
    part.fixes.append(f"lower actor.max_seq_len (now {ac.max_seq_len})")
    return part


def placement(cfg: Config, gpus: int) -> tuple[list[str], float, float]:
    """Who uses which GPU (actor.gpu_by_index's rule: actor i on the i-th of the GPUs the learner's
    ranks leave, round robin; all on one when there is one; the evaluator on those left over, as
    common/gpus.py places it), the share of its GPU the learner's
    engines leave it, and the most the engines ask of one GPU (above 1: they do not fit)."""
    ranks, actors, tp = cfg.learner.ranks, cfg.actor.num_actors, cfg.actor.tensor_parallel_size
    util = cfg.actor.gpu_memory_utilization
    users: dict[int, list[str]] = {g: [] for g in range(gpus)}
    for r in range(min(ranks, gpus)):
        users[r].append(f"learner rank {r}")
    free = list(range(ranks, gpus)) or list(range(gpus))
    load = {g: 0.0 for g in range(gpus)}
    for i in range(actors):
        for j in range(tp):
            g = free[(i * tp + j) % len(free)]
            users[g].append(f"actor {i}")
            load[g] += util
    evaluator = evaluator_gpus(ranks, actors, tp, [str(g) for g in range(gpus)]) if cfg.learner.eval_every else None
    for g in evaluator or []:  # `omrl run` starts no evaluator where it has no GPU of its own
        users[int(g)].append("evaluator")
        load[int(g)] += util
    learner_share = min((1 - load[r] for r in range(min(ranks, gpus))), default=1.0)
    lines = [f"GPU {g}: {', '.join(u) or 'idle'}" for g, u in users.items()]
    return lines, learner_share, max(load.values())


def plan(cfg: Config, gpus: int, gpu_memory_gb: float = 80.0) -> Plan:
    """The memory plan of `cfg` on one node of `gpus` GPUs of `gpu_memory_gb` GB each (0: the CPU)."""
    if not cfg.model.path:
        raise ValueError("model.path is not set: pass --model DIR (a local model directory with config.json)")
    m, hf = read_model(cfg.model.path)
    model = {"path": cfg.model.path, **asdict(m), "max_position_embeddings": hf.get("max_position_embeddings")}
    gpu_bytes = int(gpu_memory_gb * GB) if gpus > 0 else None
    on_gpu = gpus > 0 and cfg.learner.device != "cpu"
    if gpus == 0:
        lines, learner_share, load = ["the CPU: learner and actors in host memory"], 1.0, 0.0
    else:
        lines, learner_share, load = placement(cfg, gpus)
    available = int(learner_share * gpu_bytes) if on_gpu else None
    learner = _plan_learner(cfg, m, available, gpus)
    if on_gpu and cfg.learner.ranks > gpus:
        learner.status = "does not fit"
        learner.fixes.insert(0, f"learner.ranks = {cfg.learner.ranks} needs as many GPUs: --gpus {gpus}")
    if on_gpu and learner_share <= 0:
        learner.fixes.insert(0, "the actors' engines take the learner's whole GPU: lower actor.gpu_memory_utilization "
                                "or actor.num_actors")
    elif on_gpu and gpus == 1 and learner.status == "does not fit":
        learner.notes.append(f"one GPU: the learner gets 1 - {cfg.actor.num_actors} x actor.gpu_memory_utilization "
                             f"of it ({learner_share:.2f})")
    actors = _plan_actors(cfg, m, cfg.actor.gpu_memory_utilization if gpus else None, gpu_bytes)
    if load > 1:
        actors.status = "does not fit"
        actors.fixes.insert(0, "several engines share a GPU and ask for more than all of it: lower "
                               "actor.gpu_memory_utilization or actor.num_actors, or more --gpus")
    return Plan(model, gpus, gpu_memory_gb, lines, learner, actors)


def render(p: Plan) -> str:
    """The plan as a table of lines."""
    m = p.model
    out = [f"{m['path']}: {m['parameters'] / 1e9:.2f} B parameters (hidden {m['hidden']}, {m['layers']} layers, "
           f"{m['kv_heads']} KV heads of {m['head_dim']}, vocabulary {m['vocab']}"
           f"{', tied' if m['tied'] else ''})",
           f"{p.gpus} GPU{'s' if p.gpus > 1 else ''} of {p.gpu_memory_gb:g} GB" if p.gpus else "the CPU",
           *(f"  {line}" for line in p.placement), ""]
    for title, part in (("learner, one rank", p.learner), ("vLLM, one actor's GPU", p.actors)):
        out.append(title)
        for name, size in part.lines.items():
            out.append(f"  {name:<44} {size / GB:8.2f} GB")
        if part is p.learner:
            have = "" if part.available is None else f" of {part.available / GB:.1f} GB"
            out.append(f"  {'total':<44} {part.total / GB:8.2f} GB{have}: {part.status}")
        else:
            have = "-" if part.available is None else f"{part.available / GB:.2f}"
            out.append(f"  {'KV cache held':<44} {have:>8} GB: {part.status}")
        out += [f"  note: {n}" for n in part.notes] + [f"  fix: {f}" for f in part.fixes]
        out.append("")
    out.append("fits" if p.fits else "does not fit")
    out.append("(estimates: the learner's step memory is calibrated on one measured GPU point, "
               "docs/guides/real-model.md)")
    return "\n".join(out)
