"""The demo's SFT model on the held-out goals without the mask (reading (a) of criterion.md): each
depth's held-out goals greedily and 8 samples a goal, as the demo's `before` stage plays them with it.

    python benchmarks/results/demo-textcraft/constrained/unmasked.py OUT   # OUT: the arm's --out

Writes OUT/before-unmasked.json and OUT/before-unmasked-sampled.json (the `before` files' form).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from deploy.demo import config_variant, evaluate_strata


def main(out: Path) -> None:
    unmasked = config_variant(out, "unmasked", "actor.constrain_actions", False)
    depths = ["1", "2", "3", "4"]
    greedy, sampled = evaluate_strata(unmasked, out / "sft", "textcraft",
                                      [out / "tasks" / f"depth-{d}" for d in depths], 8)
    (out / "before-unmasked.json").write_text(json.dumps(dict(zip(depths, greedy)), indent=2))
    (out / "before-unmasked-sampled.json").write_text(json.dumps(dict(zip(depths, sampled)), indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
