"""compare.png: RL with actions masked in the actors only (section 19, `../constrained/`) beside
RL with the learner scoring the masked distribution too (this arm), step by step: training
success, the entropy the learner scores, the gap between the distribution sampled and the one
scored, and the share of turns the env refused. Same command, same lr (1e-4), depth 1.

    python benchmarks/results/demo-textcraft/masked-learner/compare.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
ARMS = {"mask in the actors only (section 19)": HERE.parent / "constrained", "mask in the learner too": HERE}
PANELS = [("reward/success", "training success"), ("learner/entropy", "entropy the learner scores (nats)"),
          ("learner/mismatch_kl", "KL(behaviour || learner's proximal)"),
          ("actor/refused_turn_frac", "share of turns the env refused")]

fig, axes = plt.subplots(1, len(PANELS), figsize=(16, 3.6))
for label, folder in ARMS.items():
    rows = [json.loads(line) for line in (folder / "rl_metrics.jsonl").read_text().splitlines()]
    for ax, (key, title) in zip(axes, PANELS):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
        ax.plot(*zip(*points), marker=".", label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
axes[2].set_yscale("log")
axes[0].legend(fontsize=8)
fig.suptitle("TextCraft RL with actions decoded as the env's (lr 1e-4, depth 1)", fontsize=11)
fig.tight_layout()
fig.savefig(HERE / "compare.png", dpi=90)
