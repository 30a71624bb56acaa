"""The seeds' figures (criterion.md, "Seeds 1 and 2"): each seed's change in the held-out goals of
depths 1-3 pooled, greedy and sampled (pass@1 clustered by goal), and their mean with its 95%
t-interval.

    python benchmarks/results/demo-textcraft/masked-shuffled-depths123/seeds.py [DIR]   # default: here
"""

import json
import sys
from pathlib import Path

from deploy.demo import pool_gain, pooled, seed_names

folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
depths = ["1", "2", "3"]
for kind in ("", "-sampled"):
    read = lambda name: json.loads((folder / f"{name}{kind}.json").read_text())  # noqa: E731
    afters = [seed_names(s)[1] for s in range(3) if (folder / f"{seed_names(s)[1]}{kind}.json").exists()]
    gain = pool_gain(read("before"), [read(name) for name in afters], depths)
    before = pooled([read("before")[d] for d in depths])["success"]
    print(f"{kind[1:] or 'greedy':8} depths 1-3 from {100 * before:.1f}%: "
          + ", ".join(f"{c:+.1f}" for c in gain["changes"]) + f"  mean {gain['mean']:+.1f} "
          f"[{gain['ci'][0]:+.1f}, {gain['ci'][1]:+.1f}]")
