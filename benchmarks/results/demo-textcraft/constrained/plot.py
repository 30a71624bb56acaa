"""collapse.png: the arm's RL stage step by step: training success beside the entropy of the model's
own (unmasked) distribution and the gap between it and the masked one the actors sampled from.

    python benchmarks/results/demo-textcraft/constrained/plot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
rows = [json.loads(line) for line in (HERE / "rl_metrics.jsonl").read_text().splitlines()]
panels = [("reward/success", "training success"), ("learner/entropy", "entropy of the unmasked distribution (nats)"),
          ("learner/mismatch_kl", "KL(masked behaviour || unmasked learner)"),
          ("actor/refused_turn_frac", "share of turns the env refused")]
fig, axes = plt.subplots(1, len(panels), figsize=(16, 3.4))
for ax, (key, title) in zip(axes, panels):
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
    ax.plot(*zip(*points), marker=".")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("learner step")
    ax.grid(alpha=0.3)
fig.suptitle("TextCraft, RL with actions masked in the actors only (lr 1e-4, depth 1)", fontsize=11)
fig.tight_layout()
fig.savefig(HERE / "collapse.png", dpi=90)
