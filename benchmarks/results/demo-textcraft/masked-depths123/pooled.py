"""The criterion's figures (criterion.md): the held-out goals of RL's depths (1-3) pooled, and depth
4 (left out), after SFT and after RL, greedy and sampled (pass@1 clustered by goal).

    python benchmarks/results/demo-textcraft/masked-depths123/pooled.py [DIR]   # default: this folder
"""

import json
import sys
from pathlib import Path

from deploy.demo import pooled

folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
for kind in ("", "-sampled"):
    before, after = (json.loads((folder / f"{stage}{kind}.json").read_text()) for stage in ("before", "after"))
    for label, depths in (("depths 1-3 (RL)", ["1", "2", "3"]), ("depth 4", ["4"])):
        b, a = pooled([before[d] for d in depths]), pooled([after[d] for d in depths])
        print(f"{kind[1:] or 'greedy':8} {label:16} {100 * b['success']:5.1f}% [{100 * b['success_ci'][0]:.1f}, "
              f"{100 * b['success_ci'][1]:.1f}] -> {100 * a['success']:5.1f}% [{100 * a['success_ci'][0]:.1f}, "
              f"{100 * a['success_ci'][1]:.1f}]  {100 * (a['success'] - b['success']):+.1f}")
