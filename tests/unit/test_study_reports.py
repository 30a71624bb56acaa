"""The staleness studies' reports pair each arm with the right baseline and apply their rules
as written (benchmarks/staleness.py, benchmarks/staleness_babyai.py), on runs made up here."""

import pytest

from benchmarks import staleness, staleness_babyai


def _run(arm: str, seed: int, final: float, step_s: float = 1.0) -> dict:
    return {"arm": arm, "seed": seed, "final_success": final, "step_s": step_s, "time_to_target": 50.0 * step_s,
            "steps_to_target": 40, "staleness_hist": {"0": 8}, "staleness_mean": 0.0, "frac_clipped": 0.01,
            "ess": 1.0, "wall_s": 100.0, "success": [0.1, 0.5, final], "times": [0.0, 1.0, 2.0]}


def _study(quarter: list[float], one_update: list[float]) -> dict:
    finals = {"sync": [0.5, 0.6, 0.4], "sync, lr/4": [0.9, 0.8, 0.7], "decoupled eta=4, 1 update": one_update,
              "decoupled eta=4, lr/4": quarter, "decoupled eta=4": [0.3, 0.3, 0.3]}
    runs = [_run(arm, seed, f, 2.0 if arm.startswith("sync") else 1.0)
            for arm, fs in finals.items() for seed, f in enumerate(fs)]
    return staleness.report(runs, 80, list(finals))


def test_the_lr4_arm_is_paired_with_sync_at_its_learning_rate():
    result = _study([0.8, 0.8, 0.8], [0.7, 0.6, 0.5])
    s = result["summary"]
    assert s["decoupled eta=4, lr/4"]["vs_sync"][0] == pytest.approx(0.8 - 0.8)  # against sync, lr/4
    assert s["decoupled eta=4"]["vs_sync"][0] == pytest.approx(0.3 - 0.5)  # against sync
    assert s["sync, lr/4"]["vs_sync"][0] == pytest.approx(0.8 - 0.5)  # what the lr does to sync
    labels = [r["measure"] for r in result["rows"]]
    assert "decoupled eta=4, lr/4 vs sync, lr/4: optimizer steps per second" in labels
    assert "decoupled eta=4 vs sync: optimizer steps per second" in labels


@pytest.mark.parametrize("quarter, adopted", [([0.66, 0.6, 0.44], True), ([0.5, 0.6, 0.44], False)])
def test_the_follow_up_rule_adopts_a_quarter_lr_at_a_mean_difference_of_minus_five_points(quarter, adopted):
    # against one update's mean 0.6: -0.033 (adopted) and -0.087 (not)
    one = [0.7, 0.6, 0.5]
    rule = _study(quarter, one)["trust_region"]
    mean_diff = sum(q - o for q, o in zip(quarter, one)) / 3
    assert rule["quarter_lr_less_one_update"][0] == pytest.approx(mean_diff)
    assert rule["quarter_lr_default"] is adopted is (mean_diff >= -0.05)


def test_the_babyai_report_pairs_seeds_and_judges_the_ratio_of_means():
    runs = [{"arm": arm, "seed": s, "held_out": h, "final_success": 0.8, "rl_s": 600.0, "staleness_mean": m,
             "frac_clipped": 0.01, "success": [0.7, 0.8, 0.9]}
            for arm, hs, m in (("sync", [0.80, 0.90, 0.85], 0.0), ("async eta=4", [0.78, 0.86, 0.82], 3.0))
            for s, h in enumerate(hs)]
    result = staleness_babyai.report(runs, before=0.70)
    assert result["async_less_sync"][0] == pytest.approx((-0.02 - 0.04 - 0.03) / 3)
    assert result["async_over_sync"] == pytest.approx(2.46 / 2.55)
    assert result["goal_met"] is True  # 0.965 >= 0.95
    worse = [dict(r, held_out=r["held_out"] - 0.1) if r["arm"] != "sync" else r for r in runs]
    assert staleness_babyai.report(worse, before=0.70)["goal_met"] is False
    assert "| async eta=4 | 3 |" in result["table"]
