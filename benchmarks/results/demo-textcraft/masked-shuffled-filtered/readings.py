"""The figures of criterion.md for the arm and its control: held-out depths 1-3 pooled (pass@1
clustered by goal, and greedy) before and after RL, each depth's change, depth 4's, the share
of the groups read that had no signal, learner/mismatch_kl, and the RL stage's wall time.

    python benchmarks/results/demo-textcraft/masked-shuffled-filtered/readings.py DIR [DIR ...]

DIR: a demo's --out (before*.json, after*.json, rl/metrics.jsonl, stages.json), or a folder of
its copied results (rl_metrics.jsonl in place of rl/metrics.jsonl); with --seeds N, each seed's
RL stage in turn (rl-seed1/, after-seed1*.json, ...).
"""

import json
import sys
from pathlib import Path

from deploy.demo import pooled, seed_names

DEPTHS = ["1", "2", "3"]


def metrics(folder: Path, rl: str) -> list[dict]:
    path = folder / rl / "metrics.jsonl"
    path = path if path.exists() else folder / f"{rl}_metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(folder: Path) -> None:
    seed = 0
    while (folder / f"{seed_names(seed)[1]}.json").exists():
        seed_readings(folder, seed)
        seed += 1


def seed_readings(folder: Path, seed: int) -> None:
    rl, after_name = seed_names(seed)
    print(f"== {folder}, seed {seed}")
    for kind in ("-sampled", ""):
        read = lambda name: json.loads((folder / f"{name}{kind}.json").read_text())  # noqa: E731
        before, after = read("before"), read(after_name)
        b, a = pooled([before[d] for d in DEPTHS]), pooled([after[d] for d in DEPTHS])
        per = ", ".join(f"depth {d} {100 * (after[d]['success'] - before[d]['success']):+.1f}" for d in [*DEPTHS, "4"])
        print(f"{kind[1:] or 'greedy':8} depths 1-3: {100 * b['success']:.1f}% [{100 * b['success_ci'][0]:.1f}, "
              f"{100 * b['success_ci'][1]:.1f}] -> {100 * a['success']:.1f}% [{100 * a['success_ci'][0]:.1f}, "
              f"{100 * a['success_ci'][1]:.1f}] ({100 * (a['success'] - b['success']):+.1f}); {per}")
    records = metrics(folder, rl)
    trained = sum(r["batch/groups"] for r in records)
    flat_in_batch = sum(r["batch/groups"] * r["batch/zero_signal_frac"] for r in records)
    filtered = sum(r.get("batch/filtered", 0) for r in records)
    kl = [r["learner/mismatch_kl"] for r in records if "learner/mismatch_kl" in r]
    stages = json.loads((folder / "stages.json").read_text())
    print(f"groups read {trained + filtered}: {filtered} filtered, {trained} trained ({flat_in_batch:.0f} of them "
          f"without signal); without signal {(filtered + flat_in_batch) / (trained + filtered):.3f} of those read")
    print(f"steps {len(records)}, of them training nothing {sum('learner/skipped' in r for r in records)}; "
          f"mismatch_kl mean {sum(kl) / max(len(kl), 1):.4f} max {max(kl, default=0):.4f}; "
          f"RL stage {stages[rl] / 60:.1f} min, after {stages[after_name] / 60:.1f} min; training success first 5 "
          f"steps {sum(r['reward/success'] for r in records[:5]) / 5:.3f}, last 5 "
          f"{sum(r['reward/success'] for r in records[-5:]) / 5:.3f}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        main(Path(arg))
