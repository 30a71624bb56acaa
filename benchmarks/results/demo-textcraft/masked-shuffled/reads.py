"""Reading (d) of criterion.md: does the policy read? The held-out goals of depth 1 in worlds of
shuffled names (`env.options.shuffle_names = 1`: no answer there is known by heart), masked,
greedily and 8 samples a goal at temperature 1, by the SFT model and by the RL model.

    python benchmarks/results/demo-textcraft/masked-shuffled/reads.py OUT   # OUT: the arm's --out

Prints and writes OUT/reads.json: each model's greedy and sampled success with its interval.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from deploy.demo import config_variant, evaluate_strata


def main(out: Path) -> None:
    shuffled = config_variant(out, "shuffled", "env.options.shuffle_names", 1)
    found = {}
    for model in ("sft", "rl-model"):
        greedy, sampled = evaluate_strata(shuffled, out / model, "textcraft", [out / "tasks" / "depth-1"], 8)
        found[model] = {kind: {key: result[0][key] for key in ("success", "success_ci", "episodes")}
                        for kind, result in (("greedy", greedy), ("sampled", sampled))}
        print(model, json.dumps(found[model]), flush=True)
    (out / "reads.json").write_text(json.dumps(found, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
