"""The control of section 16 (docs/results/textcraft-demo.md): the RL stage's supervised term
without RL's loss. From a demo's output directory DIR that holds the SFT model and the DAgger file
(`omrl demo textcraft ... --dagger 0.5`, after its dagger stage): SFT from DIR/sft on
DIR/dagger.parquet for as many updates of 16 episodes as the RL stage's term made (40 steps of 4),
at its peak lr, then the demo's evaluation of DIR/sft-dagger (greedy and 8 samples a held-out goal):
DIR/control.json and DIR/control-sampled.json.

    python benchmarks/results/demo-textcraft/dagger-all-depths/control.py DIR
"""

import json
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from common.cli import run_omrl
from deploy.demo import evaluate_strata

UPDATES, BATCH, LR = 160, 16, 2e-4  # the RL stage's term: 40 steps, 4 optimizer updates of 16 episodes each

if __name__ == "__main__":  # vLLM's engine starts processes that import this file again
    out = Path(sys.argv[1])
    data = out / "dagger.parquet"
    epochs = UPDATES * BATCH / pq.read_metadata(data).num_rows
    t0 = time.monotonic()
    run_omrl(["sft", "--config", str(out / "config.toml"), "--data", str(data), "--model", str(out / "sft"),
              "--out", str(out / "sft-dagger"), "--epochs", str(epochs), "--lr", str(LR), "--warmup", "0",
              "--batch-size", str(BATCH), "--holdout", "0", "--eval-episodes", "0", "--no-eval-start"],
             out / "logs" / "control-sft.log")
    t1 = time.monotonic()
    depths = ["1", "2", "3", "4"]
    greedy, sampled = evaluate_strata(out, out / "sft-dagger", "textcraft",
                                      [out / "tasks" / f"depth-{d}" for d in depths], 8)
    (out / "control.json").write_text(json.dumps(dict(zip(depths, greedy, strict=True)), indent=2))
    (out / "control-sampled.json").write_text(json.dumps(dict(zip(depths, sampled, strict=True)), indent=2))
    print(f"control: sft {t1 - t0:.0f} s, evaluation {time.monotonic() - t1:.0f} s")
