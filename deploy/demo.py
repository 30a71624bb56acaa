"""`omrl demo babyai`: from an oracle to an agent that RL improves, end to end on one machine.

    1. tasks      BabyAI levels (default 1 GoToRedBallGrey, 4 GoToObjS6, 5 GoToLocalS8N7), in
                  AgentGym's indexing (task i: level i % 40 + 1, seed i // 40); seeds of the test
                  range never appear in training
    2. model      a 0.76M-parameter Qwen2 from scratch with a word tokenizer learned from BabyAI's text
    3. collect    the oracle's episodes on the train split (`omrl collect`)
    4. sft        supervised fine-tuning on them (`omrl sft`), with a held-out success curve
    5. before     the SFT model plays 1,000 held-out episodes per level, greedily
    6. rl         the async loop (`omrl run`: Redis, env server, vLLM actors, learner) from the
                  SFT model on the RL levels' train split
    7. after      the RL model plays the same held-out episodes
    8. report     OUT/report.md (the table with 95% intervals, the wall time of each stage),
                  OUT/report.json, OUT/demo.png (SFT curve, RL curve, before/after)

Each stage but the evaluations is a command of its own, run as a child process (its log under
OUT/logs); a stage recorded as done in OUT/stages.json is skipped, so an interrupted demo goes on
where it stopped (--fresh starts over).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from common.config import to_toml
from common.files import write_atomic
from common.progress import Progress

log = logging.getLogger("omrl.demo")

TEST_SEEDS = 100_000  # held-out seeds start here: far from every seed the train split uses


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", choices=("babyai",), help="the recipe")
    p.add_argument("--out", default="runs/demo-babyai", help="where everything goes (default runs/demo-babyai)")
    p.add_argument("--levels", default="1,4,5", help="BabyAI levels (1-40) of the data and the evaluation")
    p.add_argument("--rl-levels", default="5", help="levels the RL stage trains on (default 5: GoToLocal)")
    p.add_argument("--train-seeds", type=int, default=4000, help="seeds 0..N-1 of each level form the train split")
    p.add_argument("--episodes", type=int, default=4000, help="oracle episodes to fine-tune on")
    p.add_argument("--eval-episodes", type=int, default=1000, help="held-out episodes per level, before and after")
    p.add_argument("--sft-epochs", type=float, default=2.0)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--sft-batch-size", type=int, default=32, help="episodes per SFT step")
    p.add_argument("--rl-steps", type=int, default=60, help="learner steps of the RL stage")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a field of the RL stage's config (repeatable), e.g. --set learner.lr=5e-5")
    p.add_argument("--fresh", action="store_true", help="start over: ignore the outputs of earlier stages")


# What every stage shares: AgentGym's raw action text after the observation, turns capped as
# AgentGym's client must cap them (its server never ends an episode on turns).
ACTOR = {"max_turns": 10, "max_tokens": 16, "max_seq_len": 2048, "action_template": "raw"}
# The RL stage (the ablations are in the README): GRPO with the decoupled PPO loss, no KL penalty
# (a frozen reference's forward cost a third of each step), the learner on both cores' threads.
# lr: a quarter of the 1e-4 the demo measured with one update a batch, as the default's 4
# minibatch updates a batch take it (docs/results/staleness.md).
LEARNER = {"algorithm": "grpo", "lr": 2.5e-5, "kl_coef": 0.0, "groups_per_step": 8, "entropy_coef": 0.0,
           "eval_every": 0, "threads": 2}
RL_ACTOR = {"group_size": 8, "num_actors": 1, "concurrent_groups": 8, "temperature": 1.0}
MODEL = ("--hidden", "128", "--layers", "3", "--heads", "2", "--intermediate", "384")  # 0.76M parameters


def main(args: argparse.Namespace) -> int:
    from common.cli import stop_on_sigterm
    from common.logs import setup_logging

    setup_logging("demo", "INFO", sys.stderr)
    stop_on_sigterm()
    levels = _levels(args.levels, "--levels")
    rl_levels = _levels(args.rl_levels, "--rl-levels")
    if not set(rl_levels) <= set(levels):
        raise SystemExit(f"error: --rl-levels {rl_levels} must be among --levels {levels}")
    out = Path(args.out)
    if args.fresh and out.exists():
        import shutil

        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    demo = Demo(out, args, levels, rl_levels)
    demo.until_rl()
    demo.stage("rl", demo.rl)
    demo.stage("after", lambda: demo.evaluate("rl-model", "after"))
    demo.bar.close()
    report = demo.report()
    print(report, flush=True)  # before the engines' teardown at exit
    return 0


def _levels(text: str, flag: str) -> list[int]:
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"error: {flag} takes level numbers 1-40 separated by commas, got {text!r}") from None
    if not levels or not all(1 <= x <= 40 for x in levels):
        raise SystemExit(f"error: {flag} takes level numbers 1-40, got {text!r}")
    return levels


def task_ids(levels: list[int], seeds: range) -> list[int]:
    """AgentGym's indices of the levels' tasks with these seeds (task i: level i % 40 + 1, seed i // 40)."""
    return [seed * 40 + level - 1 for seed in seeds for level in levels]


STAGES = ("tasks", "model", "collect", "sft", "before", "rl", "after")


class Demo:
    def __init__(self, out: Path, args: argparse.Namespace, levels: list[int], rl_levels: list[int]):
        self.out, self.args, self.levels, self.rl_levels = out, args, levels, rl_levels
        self.times: dict[str, float] = {}
        self.skipped: list[str] = []
        self.state_path = out / "stages.json"
        self.done = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.bar = Progress(len(STAGES), "stages", "demo")

    def stage(self, name: str, body) -> None:
        if name in self.done:
            log.info("stage %s: done before (%.0f s), skipped", name, self.done[name])
            self.times[name] = self.done[name]
            self.skipped.append(name)
            self.bar.update(note=f"{name} done before")
            return
        log.info("stage %s", name)
        t0 = time.monotonic()
        body()
        self.times[name] = self.done[name] = time.monotonic() - t0
        write_atomic(self.state_path, json.dumps(self.done, indent=2))  # a later invocation resumes from it
        log.info("stage %s: %.0f s", name, self.times[name])
        self.bar.update(note=name)

    def omrl(self, name: str, *argv: str, overrides: list[str] = ()) -> None:
        """An `omrl` command as a child process, its output in OUT/logs/NAME.log."""
        from common.cli import CommandFailed, run_omrl

        try:
            run_omrl(list(argv), self.out / "logs" / f"{name}.log", overrides)
        except CommandFailed as exc:
            raise SystemExit(f"error: stage {name} failed (exit {exc.code}); its log: {exc.log_path}\n"
                             + "\n".join(exc.tail[-5:])) from None

    def until_rl(self) -> None:
        """The stages before RL: tasks, the model, the oracle's data, SFT, the evaluation before."""
        self.stage("tasks", self.tasks)
        self.stage("model", self.model)
        self.stage("collect", self.collect)
        self.stage("sft", self.sft)
        self.stage("before", lambda: self.evaluate("sft", "before"))

    # -- stages ----------------------------------------------------------------------
    def tasks(self) -> None:
        seeds, test = range(self.args.train_seeds), range(TEST_SEEDS, TEST_SEEDS + self.args.eval_episodes)
        write_tasks(self.out / "tasks" / "all", task_ids(self.levels, seeds), task_ids(self.levels, test))
        write_tasks(self.out / "tasks" / "rl", task_ids(self.rl_levels, seeds), task_ids(self.rl_levels, test))
        for level in self.levels:
            write_tasks(self.out / "tasks" / f"level-{level}", task_ids([level], seeds), task_ids([level], test))
        (self.out / "config.toml").write_text(to_toml({"env": {"name": "babyai"}, "actor": ACTOR}))

    def model(self) -> None:
        self.omrl("model", "init-model", str(self.out / "model0"), "--tokenizer", "word", "--env", "babyai",
                  "--tasks", str(self.out / "tasks" / "all"), *MODEL)

    def collect(self) -> None:
        self.omrl("collect", "collect", "--config", str(self.out / "config.toml"), "--env", "babyai",
                  "--tasks", str(self.out / "tasks" / "all"), "--episodes", str(self.args.episodes), "--out",
                  str(self.out / "oracle.parquet"), "--model", str(self.out / "model0"), "--only-success")

    def sft(self) -> None:
        self.omrl("sft", "sft", "--config", str(self.out / "config.toml"), "--data", str(self.out / "oracle.parquet"),
                  "--model", str(self.out / "model0"), "--out", str(self.out / "sft"), "--tasks",
                  str(self.out / "tasks" / "all"), "--epochs", str(self.args.sft_epochs), "--lr", str(self.args.sft_lr),
                  "--batch-size", str(self.args.sft_batch_size),
                  "--eval-every", str(self.args.sft_epochs / 2), "--eval-episodes", "200")

    def evaluate(self, model: str, name: str) -> None:
        results = evaluate_levels(self.out, self.out / model, self.levels)
        write_atomic(self.out / f"{name}.json", json.dumps(results, indent=2))

    def rl(self, name: str = "rl", overrides: list[str] = ()) -> None:
        """The RL stage from the SFT model: run dir OUT/NAME, its model exported to OUT/NAME-model
        (`overrides` after the command line's --set: the staleness study's arms)."""
        config = {"env": {"name": "babyai", "tasks": str(self.out / "tasks" / "rl")},
                  "actor": {**ACTOR, **RL_ACTOR}, "learner": {**LEARNER, "steps": self.args.rl_steps}}
        (self.out / "rl.toml").write_text(to_toml(config))
        self.omrl(name, "run", "--config", str(self.out / "rl.toml"), "--model", str(self.out / "sft"), "--run-dir",
                  str(self.out / name), overrides=[*self.args.overrides, *overrides])
        self.omrl(f"{name}-export", "export", str(self.out / name), str(self.out / f"{name}-model"))

    # -- the report --------------------------------------------------------------------
    def report(self) -> str:
        before = json.loads((self.out / "before.json").read_text())
        after = json.loads((self.out / "after.json").read_text())
        lines = ["| level | episodes | after SFT | after SFT + RL | change |", "|---|---|---|---|---|"]
        for level in self.levels:
            b, a = before[str(level)], after[str(level)]
            lines.append(f"| {level} {level_name(level)}{' (RL)' if level in self.rl_levels else ''} | "
                         f"{a['episodes']} | {_pct(b)} | {_pct(a)} | {100 * (a['success'] - b['success']):+.1f} |")
        stages = ", ".join(f"{k} {v / 60:.1f} min" for k, v in self.times.items())
        resumed = f" (stages {', '.join(self.skipped)} ran in an earlier invocation)" if self.skipped else ""
        lines += ["", f"Wall time {sum(self.times.values()) / 60:.1f} min, the sum of the stages{resumed}: {stages}."]
        text = "\n".join(lines)
        (self.out / "report.md").write_text(text + "\n")
        write_atomic(self.out / "report.json", json.dumps({"before": before, "after": after, "times_s": self.times,
                                                           "rl_levels": self.rl_levels}, indent=2))
        plot_demo(self.out, self.levels, before, after)
        return text


def write_tasks(out: Path, train: list[int], test: list[int]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    for split, idx in (("train", train), ("test", test)):
        pq.write_table(pa.table({"env": ["babyai"] * len(idx), "task_idx": pa.array(idx, pa.int64()),
                                 "split": [split] * len(idx)}), out / f"{split}.parquet")


def evaluate_levels(out: Path, model: Path, levels: list[int]) -> dict[str, dict]:
    """The model plays each level's held-out tasks greedily, with one engine: {level: EvalResult as a dict}."""
    import asyncio
    import dataclasses

    from common.cli import override
    from common.config import load_config
    from deploy.evaluate import ModelPlayer
    from envs.tasks import read_tasks

    cfg = load_config(out / "config.toml", [override("model.path", str(model))])

    async def play() -> dict[str, dict]:
        results = {}
        async with ModelPlayer(cfg, "babyai") as player:
            for level in levels:
                tasks = read_tasks(out / "tasks" / f"level-{level}" / "test.parquet", "babyai")
                results[str(level)] = dataclasses.asdict(await player.play(tasks))
        return results

    return asyncio.run(play())


def level_name(level: int) -> str:
    from envs.babyai import LEVELS

    return LEVELS[level - 1]


def plot_demo(out: Path, levels: list[int], before: dict, after: dict) -> Path:
    """OUT/demo.png: the SFT held-out curve, the RL training curve, and success before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.metrics import read_jsonl
    from deploy.plots import _rolling_mean, errorbar_ci

    fig, (sft_ax, rl_ax, bar_ax) = plt.subplots(1, 3, figsize=(15, 3.8))
    sft = [r for r in read_jsonl(out / "sft" / "sft_metrics.jsonl") if "eval/success" in r]
    errorbar_ci(sft_ax, [r["epoch"] for r in sft], [r["eval/success"] for r in sft],
              [r["eval/success_ci"] for r in sft], "o-")
    sft_ax.set(title="SFT: held-out success, all levels (greedy)", xlabel="epoch")
    rl = read_jsonl(out / "rl" / "metrics.jsonl")
    steps, success = [r["step"] for r in rl], [r.get("reward/success", float("nan")) for r in rl]
    rl_ax.plot(steps, success, alpha=0.3, label="per step")
    rl_ax.plot(steps, _rolling_mean(success, 10), label="mean of 10")
    rl_ax.set(title="RL: training success (sampled, T=1)", xlabel="learner step")
    rl_ax.legend(fontsize=8)
    x = range(len(levels))
    for shift, (label, results) in ((-0.2, ("after SFT", before)), (0.2, ("after SFT + RL", after))):
        ys = [results[str(level)]["success"] for level in levels]
        cis = [results[str(level)]["success_ci"] for level in levels]
        bar_ax.bar([i + shift for i in x], ys, width=0.4, label=label)
        errorbar_ci(bar_ax, [i + shift for i in x], ys, cis, "none", color="black")
    bar_ax.set_xticks(list(x), [f"{level} {level_name(level)}" for level in levels], fontsize=8)
    bar_ax.set(title="held-out success per level (95% CI)", ylim=(0, 1))
    bar_ax.legend(fontsize=8, loc="lower right")
    for ax in (sft_ax, rl_ax, bar_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "demo.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _pct(r: dict) -> str:
    return f"{100 * r['success']:.1f}% [{100 * r['success_ci'][0]:.1f}, {100 * r['success_ci'][1]:.1f}]"

