"""Can a model learn to read TextCraft's recipes? (criterion.md in this folder, written before the
runs.) Depth-1 train goals of the demo's split, 40 variants each, every task a world of shuffled
names; the oracle's successful episodes; SFT of two shapes from random weights, each evaluated after
a sixth of its epochs on the 33 held-out depth-1 goals in shuffled worlds, greedily.

    python benchmarks/results/demo-textcraft/reading/study.py OUT     # about 45 minutes on 2 cores
    python benchmarks/results/demo-textcraft/reading/study.py OUT --summary
    python benchmarks/results/demo-textcraft/reading/study.py OUT2 --shapes small --variants 120 --epochs 2

Writes OUT/summary.json and prints a table; each shape's SFT curve is OUT/sft-SHAPE/sft_metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common.cli import override, run_omrl
from common.config import to_toml
from deploy.demo import MODEL, TEXTCRAFT, interleave, textcraft_split, write_tasks

SHAPES = {"small": MODEL, "deep": ("--hidden", "128", "--layers", "4", "--heads", "4", "--intermediate", "384")}
SHUFFLED = [override("env.options.shuffle_names", 1)]  # every task a world of its own names
DEMO = TEXTCRAFT.defaults  # the demo's split, collect noise (0.2), SFT lr (1e-3) and batch (16 episodes)


def split(variants: int) -> dict:
    """The demo's split (its held-out goals, split seed and RL depths), with `variants` tasks a train goal."""
    return textcraft_split(argparse.Namespace(**{**DEMO, "variants": variants}))[0]


def omrl(out: Path, name: str, *argv: str, overrides: list[str] = ()) -> float:
    """An `omrl` command, its output in OUT/NAME.log: its wall time."""
    started = time.monotonic()
    run_omrl(list(argv), out / f"{name}.log", overrides)
    return time.monotonic() - started


def run(out: Path, shapes: list[str], variants: int, epochs: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    every = split(10)  # the demo's tasks of every depth: the tokenizer learns its words from them
    write_tasks(out / "tasks" / "all", "textcraft", interleave([tr for tr, _te in every.values()]),
                interleave([te for _tr, te in every.values()]))
    train, test = split(variants)["1"]
    write_tasks(out / "tasks" / "depth-1", "textcraft", train, test)
    actor = {**TEXTCRAFT.actor, "max_turns": 12}
    (out / "config.toml").write_text(to_toml({"env": {"name": "textcraft"}, "actor": actor}))
    times = {}
    for shape in shapes:
        argv = SHAPES[shape]
        times[f"model-{shape}"] = omrl(out, f"model-{shape}", "init-model", str(out / f"model-{shape}"), "--tokenizer",
                                       "word", "--env", "textcraft", "--tasks", str(out / "tasks" / "all"), *argv,
                                       "--template", "turns")
    times["collect"] = omrl(out, "collect", "collect", "--config", str(out / "config.toml"), "--env", "textcraft",
                            "--tasks", str(out / "tasks" / "depth-1"), "--episodes", str(len(train)), "--out",
                            str(out / "oracle.parquet"), "--model", str(out / f"model-{shapes[0]}"), "--only-success",
                            "--noise", str(DEMO["collect_noise"]), overrides=SHUFFLED)
    for shape in shapes:
        times[f"sft-{shape}"] = omrl(out, f"sft-{shape}", "sft", "--config", str(out / "config.toml"), "--data",
                                     str(out / "oracle.parquet"), "--model", str(out / f"model-{shape}"), "--out",
                                     str(out / f"sft-{shape}"), "--tasks", str(out / "tasks" / "depth-1"),
                                     "--epochs", str(epochs), "--lr", str(DEMO["sft_lr"]), "--batch-size",
                                     str(DEMO["sft_batch_size"]), "--eval-every", str(epochs / 6), "--eval-episodes",
                                     str(len(test)), "--no-eval-start", overrides=SHUFFLED)
        (out / "times.json").write_text(json.dumps(times, indent=2))
    summary(out, shapes)


def vocabulary(out: Path, shape: str) -> dict:
    """How the tokenizer writes the 312 name words a shuffled world draws from."""
    from transformers import AutoTokenizer

    from envs.textcraft import _name_words

    tokenizer = AutoTokenizer.from_pretrained(out / f"model-{shape}")  # the same words for every shape
    pieces = [len(tokenizer.encode(" " + word)) for word in _name_words()]
    return {"name_words": len(pieces), "one_token": sum(p == 1 for p in pieces), "most_tokens": max(pieces)}


def summary(out: Path, shapes: list[str]) -> None:
    from common.metrics import read_jsonl

    times = json.loads((out / "times.json").read_text())
    result = {"vocabulary": vocabulary(out, shapes[0]), "times_s": times, "shapes": {}}
    print(f"name words as one token: {result['vocabulary']['one_token']} of {result['vocabulary']['name_words']}")
    print("shape  epoch  train loss  held-out loss  held-out shuffled greedy success [95%]")
    for shape in shapes:
        rows = [r for r in read_jsonl(out / f"sft-{shape}" / "sft_metrics.jsonl") if "eval/success" in r]
        result["shapes"][shape] = rows
        for r in rows:
            ci = r.get("eval/success_ci", [float("nan")] * 2)
            print(f"{shape:6} {r['epoch']:5.1f}  {r['sft/loss']:10.3f}  {r.get('sft/heldout_loss', float('nan')):13.3f}"
                  f"  {r['eval/success']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]")
    (out / "summary.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--shapes", default="small,deep", help="which of " + ", ".join(SHAPES))
    p.add_argument("--variants", type=int, default=40, help="tasks (worlds) a train goal")
    p.add_argument("--epochs", type=float, default=6)
    p.add_argument("--summary", action="store_true", help="only the table, from a finished run")
    a = p.parse_args()
    shapes = a.shapes.split(",")
    if unknown := set(shapes) - set(SHAPES):
        p.error(f"--shapes: unknown {', '.join(sorted(unknown))}; the shapes are {', '.join(SHAPES)}")
    summary(a.out, shapes) if a.summary else run(a.out, shapes, a.variants, a.epochs)
