"""Your own agent, trained (issue 29): `omrl run --config examples/own-agent/run.toml`, the ReAct
agent of examples/own-agent playing `letters` through each actor's OpenAI-compatible endpoint
on real vLLM engines, learns, as the default run learns through the episode loop. The same run
checks what else an agent run must do: the evaluator plays the held-out tasks with the agent,
every group is accounted for, the actors count the endpoint's calls, and every metric is
documented.

The criterion, chosen before the runs (the default run's): over 80 steps, the last fifth's mean
reward beats the first fifth's by at least 0.3, and no random order of the same steps' rewards
does as well in 1,000 (permutation p < 0.001). One run before this test reached 0.018 -> 0.688
(gain 0.67, p 0.0001) over 78 steps on 2 cores shared with other tests."""

import subprocess
import sys
import time

import pytest

from common.metrics import read_jsonl
from tests.budget import patience
from tests.e2e.learning import fifths

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.redis]


@pytest.mark.timeout(patience(330))
def test_the_example_agent_learns_letters_through_the_endpoint(tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "run", "--config", "examples/own-agent/run.toml",
                           "--run-dir", str(run_dir), "--set", "learner.steps=80", "--set", "learner.eval_every=40",
                           "--set", "learner.eval_tasks=16"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=patience(300))
    out = proc.stdout
    print(out[-3000:])
    print(f"omrl run took {time.monotonic() - started:.0f}s")
    assert proc.returncode == 0, out[-4000:]

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 81))
    reward = fifths(rows, "reward/mean")
    print(f"reward {reward}")
    assert reward.gain >= 0.3 and reward.p < 0.001, [r["reward/mean"] for r in rows]
    # Nearly every episode is one sequence: the tiny template extends the conversation, and only a
    # completion that does not re-encode to its own tokens (an end-of-text token, say) splits it.
    segments = [r["batch/segments_per_episode"] for r in rows]
    assert all(1.0 <= s < 1.5 for s in segments), segments
    accounting = next(line for line in out.splitlines() if "started =" in line)
    assert " 0 failed " in accounting and " 0 dead-lettered " in accounting, accounting
    # The actors served the endpoint and counted its calls: two a two-turn episode.
    for path in sorted((run_dir / "actors").glob("*.jsonl")):
        last = read_jsonl(path)[-1]
        assert last["actor/agent_calls"] >= 2 * last["actor/agent_extended"] > 0, last
    # The evaluator played the held-out tasks with the agent, through its own endpoint, once in each
    # slot of 40 versions: the newest version of the slot when it got to it (version 3 rather than 0
    # where its engine came up after the learner's first steps, as on a loaded CI machine).
    evaluator_log = (run_dir / "logs" / "evaluator.log").read_text()
    assert "plays the episodes through the endpoint" in evaluator_log, evaluator_log[-2000:]
    evals = {r["eval/version"]: r["eval/reward"] for r in rows if "eval/version" in r}
    by_slot = {version // 40: reward for version, reward in sorted(evals.items())}
    assert {0, 1} <= set(by_slot) and by_slot[1] > by_slot[0], evals
    from tests.metrics_doc import undocumented

    assert undocumented(k for r in rows for k in r) == []
    assert "Traceback" not in out
