"""`omrl bench shards`: each learner rank's peak host memory with FSDP2 on 2 gloo ranks,
against one full fp32 copy of what training holds (issue 25: at most 0.6 of it per rank
with 2 ranks).

Two ranks on the CPU are started by the torchrun command `omrl run` starts the learner with
(`deploy.supervisor.learner_launcher`), each running this module's `rank_main`: the learner's
own path, as `learner/worker.py` runs it: `learner.distributed.setup` (process group),
`FSDP2.load_model` (built on the meta device, decoder layers sharded, each rank reading its
rows from the safetensors files: `load_shards`), the KL reference only where the learner
config loads one (learner.kl_coef > 0; its default, 0, loads none), `Trainer` (which wraps
with `fully_shard` and builds AdamW), then `Trainer.train_step`s on one rollout group of 8
sequences of 64-128 tokens, half of each generated. The first step allocates AdamW's
moments in its optimizer step; the second holds them from its start, as every later step
does. After the second, a checkpoint as the learner writes one (`Trainer.save_checkpoint`,
background: each rank copies its shards of the model and AdamW state, then writes them from
a thread over a gloo group of their own; rank 0 then names the directory: `finish`), and
steps 3 and 4. Learner config: the defaults, with learner.parallel = "fsdp2",
learner.device = "cpu" (fp32, 1 torch thread per rank) and learner.gradient_checkpointing on,
as `omrl run` sets it for a real-size model; the embedding and output layer split by
vocabulary across the ranks (learner.vocab_parallel, the default). Baselines in the same run,
steps 1 and 2: the two gathered whole by FSDP2 (vocab_parallel = false), and no gradient
checkpointing (the learner's own default, which this batch's activations decide).

The same run then goes on on 1 rank from the step-2 checkpoint (step 3, a checkpoint) and
on 2 ranks again from that one (step 4): after each step every run records the squared norm
of its weights (over every rank's shards), and a resumed run must match the uninterrupted
one far closer than one step moves it (AdamW's moments included: without them step 4
moves elsewhere). Rows besides the memory: the loop's cost per checkpoint (the call, and how much longer the
step beside the background copy and write took than the steps before and after it) at the
cadence `omrl run` gives this model (`learner.checkpoint_every`: 10 for a real-size model)
against that many steps (goal 0.10), and what was left of the write after that step.

The learner returns freed host memory at once (`learner.return_freed_memory`, a fixed glibc
mmap threshold: `learner/host_memory.py`); a fourth run, steps 1-4 on 2 ranks with glibc's
default instead, is the baseline for what that saves and what its page faults cost in step
time. Nothing is trimmed between phases: each rank's memory as the learner's would be.

Each rank samples its own resident set (`PeakRss`: /proc/self/statm every 2 ms) over each
phase, and reads the kernel's high-water mark (VmHWM) as a check; it writes its figures, and
this process collects them. Rows, per rank: the peak RSS at start (process group, sharded
load, wrap, AdamW) and during the first and the second step, all absolute (the Python and
torch runtime included), against 16 bytes x the parameter count: fp32 parameters, gradients
and AdamW's two moments, one full copy. system = the measured bytes, baseline = the full
copy's bytes, so the ratio IS the fraction of a full copy (lower is better; 0.5 is a perfect
2-way shard with nothing else resident).

Full mode: a model in Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
MLP 4864, vocabulary 151,936, tied embeddings: 494M parameters), built here with random
weights and saved with save_pretrained; nothing is downloaded. `--quick`: hidden 64, 2
layers, vocabulary 4096, where the runtime dwarfs the model (ratios far above 1). GPU memory
is not measured: the ranks run on the CPU whatever `--device` says.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import pyplot, spread
from benchmarks.learner import G, PeakRss, Shape, make_groups

RANKS = 2
BYTES_PER_PARAM = 16  # fp32 parameter + gradient + AdamW's exp_avg and exp_avg_sq
GOAL = 0.6  # issue 25: a rank's peak over one full copy, at 2 ranks
# Qwen2.5-0.5B's config.json, less what does not change memory (rope_theta, max_position_embeddings: buffers only)
MODEL = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
         "intermediate_size": 4864, "vocab_size": 151_936, "tie_word_embeddings": True}
QUICK = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 256, "vocab_size": 4096, "tie_word_embeddings": True}
BATCH = Shape(groups=1, max_len=128, batches=1, min_len=64)  # 8 sequences of 64-128 tokens
AS_RUN = ("--set", "gradient_checkpointing=true")  # what `omrl run` gives a real-size model (REAL_MODEL)
PHASES = ("setup", "load", "trainer", "step1", "step2")  # "start" is the first three
PEAKS = {"start_peak": "at start (process group, sharded load, wrap, AdamW)",
         "step1_peak": "during the first train_step (AdamW's moments allocated in it)",
         "step2_peak": "during the second train_step (AdamW's moments held throughout)",
         "checkpoint_peak": "while a checkpoint is taken and written in the background (each rank its own shards, "
                            "copied first: learner.checkpoint_async)"}
REPO = Path(__file__).resolve().parents[1]


def build_model(path: str, spec: dict) -> int:
    """A Qwen2 causal LM of `spec` with random weights, saved to `path` as safetensors; its
    parameter count (the tied output layer once)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**spec, torch_dtype="float32"))
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _status() -> dict[str, int]:
    """/proc/self/status's VmHWM, RssAnon and RssFile, in bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux 4.0+)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Phase(PeakRss):
    """PeakRss over one named phase, its figures put in `figures[name]`: the RSS on entry, the
    sampled peak, the anonymous and file-backed RSS on exit, the kernel's high-water mark since
    its last reset, and the seconds. No trim on entry: the rank's memory as the learner runs."""

    trim = False

    def __init__(self, figures: dict[str, dict], name: str):
        self.figures, self.name = figures, name

    def __enter__(self) -> Phase:
        self.t0 = time.perf_counter()
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        status = _status()
        self.figures[self.name] = {"before": self.before, "peak": self.peak, "hwm": status["VmHWM"],
                                   "rss_anon": status["RssAnon"], "rss_file": status["RssFile"],
                                   "seconds": time.perf_counter() - self.t0}
        print(f"rank {os.environ.get('RANK')}: {self.name}: peak {self.peak / 2**30:.2f} GiB (from "
              f"{self.before / 2**30:.2f}), VmHWM {status['VmHWM'] / 2**30:.2f} GiB, "
              f"{self.figures[self.name]['seconds']:.1f}s", flush=True)


def rank_main() -> None:
    """One rank, under torchrun: the learner's start (or a resume), steps --first..--last on the
    same batch, a checkpoint written in the background after step --save; its figures to
    OUT/TAG-rank{r}.json."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--first", type=int, default=1)
    p.add_argument("--last", type=int, required=True)
    p.add_argument("--save", type=int, help="checkpoint after this step, into OUT/TAG-checkpoint")
    p.add_argument("--resume", help="a checkpoint directory to start from")
    p.add_argument("--keep-freed", action="store_true", help="learner.return_freed_memory = false (glibc's default)")
    p.add_argument("--set", action="append", default=[], help="a learner config field, as FIELD=JSON")
    args = p.parse_args()

    import torch

    from common.config import LearnerConfig
    from learner.batch import collate
    from learner.checkpoint import LearnerState, finish
    from learner.distributed import setup
    from learner.host_memory import return_freed_memory
    from learner.trainer import REFERENCE_DTYPE, Trainer

    cfg = LearnerConfig(parallel="fsdp2", device="cpu", return_freed_memory=not args.keep_freed,
                        **{k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)})
    phases: dict[str, dict] = {}
    # As Learner.run: process group, seed, threads, the allocator, the reference (if kl_coef > 0), the
    # model, the Trainer.
    with Phase(phases, "setup"):
        parallel = setup(cfg.parallel, cfg.device, cfg.precision, cfg.vocab_parallel)
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.threads)
        return_freed_memory(cfg.return_freed_memory)
    with Phase(phases, "load"):
        reference = parallel.load_model(args.model, REFERENCE_DTYPE[cfg.precision], trainable=False) \
            if cfg.kl_coef > 0 else None
        model = parallel.load_model(args.model)
    with Phase(phases, "trainer"):
        trainer = Trainer(model, cfg, parallel, reference)
    start_hwm = _status()["VmHWM"]  # since the process began: the start's exact peak
    if args.resume:
        with Phase(phases, "resume"):
            trainer.load_checkpoint(Path(args.resume))
    vocab = model.config.vocab_size
    batch = collate(make_groups(np.random.default_rng(0), BATCH, vocab))
    batch.behav_logprobs = -float(np.log(vocab)) * batch.generated_mask  # near a random model's own
    figures = {"rank": parallel.rank, "world": parallel.world, "phases": phases, "norms": {},
               "start_peak": max(phases[n]["peak"] for n in PHASES[:3]), "start_hwm": start_hwm}
    for step in range(args.first, args.last + 1):
        reset = _reset_hwm()  # so VmHWM is this step's exact peak, a check on the sampled one
        with Phase(phases, f"step{step}"):
            metrics = trainer.train_step(batch)
        figures.update({f"step{step}_peak": phases[f"step{step}"]["peak"],
                        f"step{step}_hwm": _status()["VmHWM"] if reset else None})
        # The weights' squared norm over every rank's shards: the same run is at the same weights.
        # (Read while a checkpoint's copy may run: reading is all either does.)
        local = sum(float(p.to_local().double().pow(2).sum()) if hasattr(p, "to_local") else
                    float(p.detach().double().pow(2).sum()) for p in trainer.scorer.parameters())
        figures["norms"][step] = parallel.sum([local])[0]
        figures["copy_wait_s"] = figures.get("copy_wait_s", 0.0) + metrics.get("learner/time/checkpoint_copy_s", 0.0)
        if step == args.save:
            path = Path(args.out, f"{args.tag}-checkpoint", f"step-{step:08d}.tmp")
            path.mkdir(parents=True, exist_ok=True)
            with Phase(phases, "checkpoint"):  # what the loop waits for here; the copy runs beside the next step
                written = trainer.save_checkpoint(path, background=True)
        if args.save is not None and (step == args.save + 1 or step == args.last == args.save):
            with Phase(phases, "written"):  # what is left of the background copy and write
                written.result()
                if parallel.is_main:
                    finish(path, LearnerState(step=args.save, version=args.save), keep=1)
            figures["checkpoint_peak"] = max([phases["written"]["peak"]] + [
                phases[f"step{s}"]["peak"] for s in range(args.save + 1, step + 1)])
    figures.update({
               "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "peak": max(v["peak"] for v in phases.values()),
               "reference": reference is not None, "threads": torch.get_num_threads(),
               "sequences": int(batch.tokens.shape[0]), "padded_T": int(batch.tokens.shape[1]),
               "tokens": int(batch.attention_mask.sum()), "loss": metrics["learner/loss/policy"],
               "microbatches": metrics["learner/microbatches"]})
    Path(args.out, f"{args.tag}-rank{parallel.rank}.json").write_text(json.dumps(figures, indent=2) + "\n")
    if parallel.world > 1:
        torch.distributed.barrier()  # every rank leaves together (gloo pairs torn down early once aborted)
    parallel.close()


def launch(model_dir: str, out: Path, timeout: float, tag: str, ranks: int, *args: str) -> list[dict]:
    """`ranks` ranks under torchrun, as `omrl run` starts the learner; each rank's figures."""
    from deploy.supervisor import learner_launcher

    cmd = [sys.executable, "-m", *learner_launcher(ranks), "benchmarks.shards", "--model", model_dir,
           "--out", str(out), "--tag", tag, *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{tag}: the {ranks} rank(s) failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    print(done.stdout, end="", flush=True)
    return [json.loads((out / f"{tag}-rank{r}.json").read_text()) for r in range(ranks)]


def run(quick: bool, device: str = "cpu") -> dict:
    from common.config import LearnerConfig, model_defaults

    spec = QUICK if quick else MODEL
    with tempfile.TemporaryDirectory(prefix="omrl-bench-shards-") as tmp:
        out, timeout = Path(tmp), 300 if quick else 3600
        model_dir = os.path.join(tmp, "model")
        params = build_model(model_dir, spec)
        # The cadence `omrl run --model DIR` would use for this model (a real-size model's default).
        every = model_defaults({"model": {"path": model_dir}}).get("learner.checkpoint_every",
                                                                     LearnerConfig().checkpoint_every)
        files = sorted(f.name for f in Path(model_dir).glob("*.safetensors"))
        # The same run on 2 ranks, then on 1 from 2's checkpoint, then on 2 again from 1's.
        ranks = launch(model_dir, out, timeout, "two", RANKS, "--last", "4", "--save", "2", *AS_RUN)
        # The baseline for the allocator: the same steps, freed memory kept as glibc keeps it by default.
        kept = launch(model_dir, out, timeout, "kept", RANKS, "--last", "4", "--keep-freed", *AS_RUN)
        # The baselines for the vocabulary split and for gradient checkpointing: steps 1 and 2 without each.
        gathered = launch(model_dir, out, timeout, "gathered", RANKS, "--last", "2", *AS_RUN,
                          "--set", "vocab_parallel=false")
        plain = launch(model_dir, out, timeout, "plain", RANKS, "--last", "2")
        one = launch(model_dir, out, timeout, "one", 1, "--first", "3", "--last", "3", "--save", "3",
                     "--resume", str(out / "two-checkpoint" / "step-00000002"), *AS_RUN)[0]
        again = launch(model_dir, out, timeout, "again", RANKS, "--first", "4", "--last", "4",
                       "--resume", str(out / "one-checkpoint" / "step-00000003"), *AS_RUN)
    full = BYTES_PER_PARAM * params
    rows = []
    for r in ranks:
        for key, when in PEAKS.items():
            rows.append({"measure": f"rank {r['rank']} of {RANKS} (FSDP2, gloo): peak RSS bytes {when} / "
                                    f"{BYTES_PER_PARAM} B x {params / 1e6:.1f}M params (one full fp32 params + "
                                    f"grads + AdamW copy; lower is better, goal {GOAL})",
                         "system": float(r[key]), "baseline": float(full), "ratio": spread([r[key] / full])})
    for r, base in zip(ranks, gathered):
        rows.append({"measure": f"rank {r['rank']} of {RANKS}: peak RSS bytes during the second train_step, the "
                                f"embedding and output layer split by vocabulary (learner.vocab_parallel, the default) "
                                f"/ gathered whole by FSDP2 (vocab_parallel = false) (lower is better)",
                     "system": float(r["step2_peak"]), "baseline": float(base["step2_peak"]),
                     "ratio": spread([r["step2_peak"] / base["step2_peak"]])})
    # The baseline runs' second step against one full copy: what each default saves.
    for run, what in ((gathered, "embedding and output layer gathered whole (learner.vocab_parallel = false), "
                                 "info: what the split saves"),
                      (plain, "no gradient checkpointing (the learner's own default; `omrl run` turns it on for a "
                              "real-size model), info: this batch's activations"),
                      (kept, "freed memory kept (glibc's default, learner.return_freed_memory = false), info: what "
                             "returning it saves")):
        for r in run:
            rows.append({"measure": f"rank {r['rank']} of {RANKS}, {what}: peak RSS bytes during the second "
                                    f"train_step / one full copy",
                         "system": float(r["step2_peak"]), "baseline": float(full),
                         "ratio": spread([r["step2_peak"] / full])})
    lead = ranks[0]["phases"]
    step_s = (lead["step2"]["seconds"] + lead["step4"]["seconds"]) / 2  # the steps before and after: none beside them
    kept_s = (kept[0]["phases"]["step2"]["seconds"] + kept[0]["phases"]["step4"]["seconds"]) / 2
    split_s, gathered_s, plain_s = (run[0]["phases"]["step2"]["seconds"] for run in (ranks, gathered, plain))
    rows.append({"measure": "rank 0's second step time, the vocabulary split / gathered whole (the price of exchanging "
                            "activations instead of the weight; lower is better)",
                 "system": split_s, "baseline": gathered_s, "ratio": spread([split_s / gathered_s])})
    rows.append({"measure": "rank 0's second step time, gradient checkpointing / none (the price of recomputing)",
                 "system": split_s, "baseline": plain_s, "ratio": spread([split_s / plain_s])})
    rows.append({"measure": "rank 0's step time (mean of steps 2 and 4), freed memory returned at once "
                            "(learner.return_freed_memory, the default) / kept (glibc's default): the price of the "
                            "page faults (lower is better, 1 is free)",
                 "system": step_s, "baseline": kept_s, "ratio": spread([step_s / kept_s])})
    cost = lead["checkpoint"]["seconds"] + max(0.0, lead["step3"]["seconds"] - step_s)
    rows.append({"measure": f"the training loop's cost per checkpoint (rank 0: the call, plus how much longer the step "
                            f"beside the background copy and write took than the mean of the steps before and after "
                            f"it) at the default cadence "
                            f"(learner.checkpoint_every = {every}) / that many steps' time (lower is better, goal 0.10)",
                 "system": cost, "baseline": every * step_s, "ratio": spread([cost / (every * step_s)])})
    rows.append({"measure": "what was left of the background copy and write once the step beside it ended (every "
                            "rank's shards and the metadata, then renamed into place) / a step's time (below "
                            "checkpoint_every: the next checkpoint never waits)",
                 "system": lead["written"]["seconds"], "baseline": step_s,
                 "ratio": spread([lead["written"]["seconds"] / step_s])})
    moved = {s: abs(ranks[0]["norms"][str(s)] - ranks[0]["norms"][str(s - 1)]) for s in (3, 4)}
    resumed = {3: abs(one["norms"]["3"] - ranks[0]["norms"]["3"]), 4: abs(again[0]["norms"]["4"] - ranks[0]["norms"]["4"])}
    for s, how in ((3, "1 rank from the 2 ranks' checkpoint of step 2"), (4, "2 ranks from that 1 rank's checkpoint")):
        rows.append({"measure": f"resume 2 -> 1 -> 2: |the weights' squared norm after step {s}, {how}, minus the "
                                f"uninterrupted 2-rank run's| / how much step {s} moved it there (lower is better: "
                                f"0 is the same run)", "system": resumed[s], "baseline": moved[s],
                     "ratio": spread([resumed[s] / moved[s]])})
    rows.append({"measure": "1 rank (resumed from 2): peak RSS bytes over the run / one full copy (info: one rank "
                            "holds the whole state, and a checkpoint's copy of its model and AdamW state)",
                 "system": float(one["peak"]), "baseline": float(full), "ratio": spread([one["peak"] / full])})
    result = {"rows": rows, "params": params, "model": spec, "full_copy_bytes": full, "goal": GOAL, "ranks": ranks,
              "kept": kept, "gathered": gathered, "plain": plain, "as_run": AS_RUN, "one_rank": one, "again": again,
              "checkpoint_every": every,
              "files": files, "batch": {"sequences": G * BATCH.groups, "min_len": BATCH.min_len,
                                        "max_len": BATCH.max_len}, "measured_device": "cpu"}
    for r in ranks:
        print(f"shards: rank {r['rank']}: " + ", ".join(f"{k.removesuffix('_peak')} {r[k] / full:.3f}" for k in PEAKS)
              + f" of one full copy ({full / 2**30:.2f} GiB)", flush=True)
    print("shards: second step, embedding and output layer gathered whole " + ", ".join(
        f"rank {r['rank']} {r['step2_peak'] / full:.3f}" for r in gathered) + "; no gradient checkpointing " + ", ".join(
        f"rank {r['rank']} {r['step2_peak'] / full:.3f}" for r in plain) + f"; step time split / gathered "
          f"{split_s / gathered_s:.3f}, checkpointing / none {split_s / plain_s:.3f}", flush=True)
    print("shards: freed memory kept (glibc's default): second step " + ", ".join(
        f"rank {r['rank']} {r['step2_peak'] / full:.3f}" for r in kept) + f"; returned at once, the step takes "
          f"{step_s / kept_s:.3f} of the time", flush=True)
    print(f"shards: a checkpoint cost the loop {cost:.2f} s (the call {lead['checkpoint']['seconds']:.2f} s, the step "
          f"beside it {lead['step3']['seconds']:.1f} s, the others {step_s:.1f} s, its update waited "
          f"{ranks[0]['copy_wait_s']:.2f} s for the copy); {lead['written']['seconds']:.1f} s left to write after it; "
          f"resume 2 -> 1 -> 2 off the uninterrupted run by {resumed[3] / moved[3]:.1e} and "
          f"{resumed[4] / moved[4]:.1e} of a step's change", flush=True)
    return result


def plot(result: dict, path) -> None:
    plt = pyplot()
    full = result["full_copy_bytes"]
    ranks = result["ranks"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(ranks))
    labels = {"start_peak": "at start (load + wrap)", "step1_peak": "first step", "step2_peak": "second step",
              "checkpoint_peak": "checkpoint (copy + write)"}
    width = 0.8 / len(labels)
    for i, (key, label) in enumerate(labels.items()):
        values = [r[key] / full for r in ranks]
        bars = ax.bar(x + (i - (len(labels) - 1) / 2) * width, values, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.2f}\n{r[key] / 2**30:.2f} GiB" for v, r in zip(values, ranks)], fontsize=7)
    ax.axhline(result["goal"], color="C2", linestyle="--", label=f"goal: {result['goal']}")
    ax.axhline(1.0, color="C3", linestyle=":", label="one full copy")
    ax.set_xticks(x, [f"rank {r['rank']}" for r in ranks])
    ax.set_ylabel(f"peak RSS / ({BYTES_PER_PARAM} B x params)")
    ax.set_ylim(0, 1.45 * max(1.0, max(r[k] / full for r in ranks for k in labels)))  # room for the legend
    ax.set_title(f"FSDP2, {len(ranks)} gloo ranks, {result['params'] / 1e6:.1f}M params "
                 f"(full copy {full / 2**30:.2f} GiB): peak host memory per rank", fontsize=9)
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    rank_main()
