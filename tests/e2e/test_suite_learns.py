"""A tiny model learns `grid_nav` from random initialisation through `omrl run`: the suite
env that depends most on its observations (the goal's direction and the walls are known
only from them). The bar is not only a gain over the first steps: the success rate at the
end must beat the best policy that ignores the observations (a fixed sequence of moves,
best of 300 random ones: 0.37 on these tasks), which only reading them can explain."""

import subprocess
import sys
import time

import pytest

from common.metrics import read_jsonl
from tests.e2e.learning import fifths

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.redis]

BLIND_SUCCESS = 0.37  # the best observation-blind sequence of 8 moves, over tasks 0-899


@pytest.mark.timeout(900)
def test_grid_nav_is_learned_from_its_observations(tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "run", "--run-dir", str(run_dir),
                           "--set", "env.name=grid_nav", "--set", "actor.max_tokens=1", "--set", "actor.max_turns=8"],
                          capture_output=True, text=True, timeout=850)
    print(done.stdout[-3000:])
    print(f"omrl run took {time.monotonic() - started:.0f}s")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    reward, success = fifths(rows, "reward/mean"), fifths(rows, "reward/success")
    print(f"reward {reward}\nsuccess {success}")
    assert reward.gain > 5 * reward.stderr and reward.gain >= 0.3, [r["reward/mean"] for r in rows]
    assert success.last > BLIND_SUCCESS + 0.1, [r["reward/success"] for r in rows]
