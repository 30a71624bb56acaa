"""The seeds' figures (criterion.md, "Seeds 1 and 2"): each seed's change in the held-out goals of
depths 1-3 pooled, greedy and sampled (pass@1 clustered by goal), and their mean with its 95%
t-interval.

    python benchmarks/results/demo-textcraft/masked-shuffled-depths123/seeds.py [DIR]   # default: here
"""

import json
import sys
from pathlib import Path

from common.stats import interval
from deploy.demo import pooled, seed_names

folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
depths = ["1", "2", "3"]
for kind in ("", "-sampled"):
    read = lambda name: json.loads((folder / f"{name}{kind}.json").read_text())  # noqa: E731
    before = pooled([read("before")[d] for d in depths])["success"]
    afters = [seed_names(s)[1] for s in range(3) if (folder / f"{seed_names(s)[1]}{kind}.json").exists()]
    changes = [100 * (pooled([read(name)[d] for d in depths])["success"] - before) for name in afters]
    mean, lo, hi = interval(changes)
    print(f"{kind[1:] or 'greedy':8} depths 1-3 from {100 * before:.1f}%: " + ", ".join(f"{c:+.1f}" for c in changes)
          + f"  mean {mean:+.1f} [{lo:+.1f}, {hi:+.1f}]")
