"""`omrl sft`: supervised fine-tuning on trajectory files (`omrl collect`, `omrl
import-trajectories`, or AgentGym conversation JSON), with a held-out success curve.

Every conversation is tokenised for the model with the actors' turn format (the same tokens
and loss masks RL trains on); a slice of the episodes is kept apart for a held-out loss. Every
`--eval-every` epochs (and at the end) the weights go into a vLLM engine, as an actor's would,
and the model plays the env's held-out tasks greedily, as `omrl eval` does: the success rate
with its 95% interval is a point of the curve (OUT/sft_metrics.jsonl, OUT/sft_curve.png). The
output is a model directory (save_pretrained) that `omrl run --model OUT` and `omrl eval` take.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import sys
import time
from pathlib import Path

from common.cli import add_config_args, config_from_args
from common.config import Config, SFTConfig

log = logging.getLogger("omrl.sft")


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--data", action="append", required=True, help="a trajectory file (.parquet, .json, .jsonl); "
                   "repeatable")
    p.add_argument("--model", required=True, help="the model to start from, path or hub id (model.path)")
    p.add_argument("--out", required=True, help="the directory to write the fine-tuned model to")
    # The settings of the run: each flag sets the [sft] field of its name (common/config.py's SFTConfig
    # holds the defaults and the bounds), after --config and --set.
    p.add_argument("--epochs", type=float, help="passes over the data (default 3)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 1e-3: a tiny model from scratch)")
    p.add_argument("--batch-size", type=int, help="episodes per optimizer step (default 32)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default 20)")
    p.add_argument("--max-tokens-per-microbatch", type=int, help="padded tokens per forward")
    p.add_argument("--holdout", type=float, help="fraction of episodes kept for a held-out loss")
    p.add_argument("--eval-env", help="env whose held-out tasks the model plays (default: the data's env)")
    p.add_argument("--eval-episodes", type=int, help="held-out tasks per evaluation (0: none)")
    p.add_argument("--eval-every", type=float, help="epochs between evaluations (default 1)")
    p.add_argument("--eval-start", action=argparse.BooleanOptionalAction,
                   help="also evaluate before the first step (default yes)")
    p.add_argument("--tasks", help="task files directory for the evaluation (env.tasks)")
    p.add_argument("--seed", type=int)


def main(args: argparse.Namespace) -> int:
    from common.cli import stop_on_sigterm
    from common.logs import setup_logging

    setup_logging("sft", "INFO", sys.stderr)  # stdout is the output directory
    stop_on_sigterm()
    flags = {f"sft.{name}": vars(args)[name] for name in SFTConfig.model_fields}
    cfg = config_from_args(args, {"model.path": args.model, "env.tasks": args.tasks or None, **flags})
    print(asyncio.run(fine_tune(cfg, args.data, Path(args.out))), flush=True)
    return 0


def load_examples(cfg: Config, paths: list[str]) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
    """(tokens, loss_mask) of every episode of the files for the model's tokenizer, and their envs."""
    from actors.chat import make_format
    from actors.trajectories import TrajectoryError, read_episodes, tokenize
    from deploy.evaluate import tokenizer_of

    fmt = make_format(tokenizer_of(cfg), cfg.actor.chat_template, cfg.actor.stop)
    examples, envs = [], []
    try:
        for path in paths:
            for n, row in enumerate(read_episodes(path)):
                examples.append(tokenize(fmt, row["conversations"], f"{path}, record {n}"))
                envs.append(row.get("env"))
    except TrajectoryError as exc:
        raise SystemExit(f"error: {exc}") from None
    if not examples:
        raise SystemExit(f"error: no episodes in {', '.join(paths)}")
    return examples, envs


async def fine_tune(cfg: Config, data: list[str], out: Path) -> Path:
    """Fine-tune cfg.model.path on the episodes of the `data` files by cfg.sft; the model, saved in `out`."""
    import torch

    from common.metrics import Sinks
    from common.models import load_causal_lm, save_policy
    from common.progress import Progress
    from deploy.evaluate import ModelPlayer, eval_row
    from envs.tasks import task_split
    from learner.host_memory import return_freed_memory
    from learner.sft import SFTTrainer

    sft = cfg.sft
    started = time.monotonic()
    examples, envs = load_examples(cfg, data)
    random.Random(sft.seed).shuffle(examples)
    held = examples[:int(len(examples) * sft.holdout)]
    train = examples[len(held):]
    eval_env = sft.eval_env or next((e for e in envs if e), None)
    tasks: list[int] = []
    if sft.eval_episodes:
        if not eval_env:
            raise SystemExit("error: the data names no env: pass --eval-env NAME (or --eval-episodes 0)")
        try:
            tasks = list(task_split(cfg.env.model_copy(update={"name": eval_env}))[1])[:sft.eval_episodes]
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    steps_per_epoch = max(1, len(train) // sft.batch_size)
    total = max(1, round(sft.epochs * steps_per_epoch))
    eval_steps = {min(total, round(k * sft.eval_every * steps_per_epoch))
                  for k in range(1, int(sft.epochs / sft.eval_every) + 1)} | {total}
    log.info("%d episodes (%d trained tokens), %d held out; %d steps of %d episodes; evaluating on %s at steps %s",
             len(train), sum(sum(m) for _t, m in train), len(held), total, sft.batch_size, eval_env,
             sorted(eval_steps) if sft.eval_episodes else "none")
    torch.manual_seed(sft.seed)
    return_freed_memory(cfg.learner.return_freed_memory)
    model = load_causal_lm(cfg.model.path)
    if cfg.learner.ranks > 1:
        log.warning("omrl sft trains in one process: learner.ranks=%d is not used", cfg.learner.ranks)
    trainer = SFTTrainer(model, cfg.learner, sft, total)
    log.info("training on %s (%s, gradient checkpointing %s)", trainer.device, cfg.learner.precision,
             "on" if cfg.learner.gradient_checkpointing else "off")
    out.mkdir(parents=True, exist_ok=True)
    sink = Sinks(out, cfg, jsonl="sft_metrics.jsonl", fresh=True)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(sink.close)
        player = await stack.enter_async_context(ModelPlayer(cfg, eval_env)) if tasks else None

        async def held_out(step: int) -> dict:
            await player.load(trainer.state_dict())
            return eval_row(await player.play(tasks, step))

        if player is not None and sft.eval_start:
            sink.write({"step": 0, "epoch": 0.0, **await held_out(0)})
        rng = random.Random(sft.seed + 1)
        order: list[int] = []
        bar = stack.enter_context(Progress(total, "steps", "sft"))
        for step in range(1, total + 1):
            if len(order) < sft.batch_size:
                fresh = list(range(len(train)))
                rng.shuffle(fresh)
                order += fresh
            batch, order = [train[i] for i in order[:sft.batch_size]], order[sft.batch_size:]
            metrics = await asyncio.to_thread(trainer.step, batch)
            bar.update(note=f"loss {metrics['sft/loss']:.4f}, lr {metrics['sft/lr']:.2e}")
            if step in eval_steps:
                row = {"step": step, "epoch": step / steps_per_epoch, **metrics}
                if held:
                    row["sft/heldout_loss"] = await asyncio.to_thread(trainer.evaluate, held)
                if player is not None:
                    row.update(await held_out(step))
                row["time_s"] = time.monotonic() - started
                sink.write(row)
                log.info("step %d: held-out loss %.4f, success %s", step, row.get("sft/heldout_loss", float("nan")),
                         f"{row['eval/success']:.3f}" if "eval/success" in row else "-")
    save_policy(model, cfg.model.path, out, trainer.state_dict(), keep_others=True)  # the metrics written there
    _plot(out)
    log.info("wrote %s in %.0f s", out, time.monotonic() - started)
    return out


def _plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.metrics import read_jsonl
    from deploy.plots import errorbar_ci

    rows = read_jsonl(out / "sft_metrics.jsonl")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    losses = [r for r in rows if "sft/heldout_loss" in r]
    left.plot([r["epoch"] for r in losses], [r["sft/loss"] for r in losses], "o-", label="train (last step)")
    left.plot([r["epoch"] for r in losses], [r["sft/heldout_loss"] for r in losses], "o-", label="held-out episodes")
    left.set_title("NLL per agent token")
    evals = [r for r in rows if "eval/success" in r]
    if evals:
        y = [r["eval/success"] for r in evals]
        ci = [r["eval/success_ci"] for r in evals]
        errorbar_ci(right, [r["epoch"] for r in evals], y, ci, "o-")
    right.set_title("held-out success, greedy (95% CI)")
    for ax in (left, right):
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sft_curve.png", dpi=100)
    plt.close(fig)
