"""Reading (c) of criterion.md: what the mask costs an evaluation. The SFT model plays the held-out
goals of depth 2 as the demo's `before` stage does (greedily, then 8 samples a goal at temperature
1), with the mask and without, one after the other on the same machine, so the ratio holds whatever
else runs beside it.

    python benchmarks/results/demo-textcraft/masked-depths123/mask_cost.py OUT   # OUT: the arm's --out

Prints and writes OUT/mask_cost.json: each arm's seconds (its engine's start included: the
`before` stage's cost as the demo pays it), episodes and success, and masked / unmasked.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from deploy.demo import config_variant, evaluate_strata


def timed(config_dir: Path, out: Path) -> dict:
    t0 = time.monotonic()
    greedy, sampled = evaluate_strata(config_dir, out / "sft", "textcraft", [out / "tasks" / "depth-2"], 8)
    return {"s": time.monotonic() - t0, "greedy": greedy[0]["success"], "sampled": sampled[0]["success"],
            "episodes": greedy[0]["episodes"] + sampled[0]["episodes"]}


def main(out: Path) -> None:
    unmasked = config_variant(out, "unmasked", "actor.constrain_actions", False)
    arms = {"masked": timed(out, out), "unmasked": timed(unmasked, out)}
    arms["ratio"] = arms["masked"]["s"] / arms["unmasked"]["s"]
    (out / "mask_cost.json").write_text(json.dumps(arms, indent=2) + "\n")
    print(json.dumps(arms, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
