"""`omrl bench scale`'s arithmetic on figures made up here: the groups trained in a window
count whole steps, and the goals compare the largest N with the smallest above 1, doorbell arm."""

import pytest

from benchmarks import scale


def test_a_window_counts_the_whole_steps_it_caught():
    trained = [(0.0, 0), (10.0, 16), (11.0, 32), (12.0, 48), (20.0, 64)]
    # Steps ending in (10.5, 15]: at 11 and 12, measured from the step before the window (10).
    assert scale.trained_between(trained, 10.5, 15.0) == (32, 2.0)
    assert scale.trained_between(trained, 12.5, 15.0) == (0, 2.5)  # no step in it: nothing taken in


def _point(loops: int, arm: str, groups_per_s: float, commands_per_group: float, redis_cpu: float) -> dict:
    return {"loops": loops, "arm": arm, "groups_per_s": groups_per_s, "commands_per_group": commands_per_group,
            "redis_cpu": redis_cpu, "wait_p99_s": 0.1}


@pytest.mark.parametrize("high_commands, high_intake, high_cpu, met", [
    (45.0, 15.0, 0.1, {"commands_flat": True, "intake_kept": True, "redis_under_half_core": True}),
    (46.0, 13.0, 0.6, {"commands_flat": False, "intake_kept": False, "redis_under_half_core": False}),
])
def test_the_goals_compare_the_largest_n_with_the_smallest_above_one(high_commands, high_intake, high_cpu, met):
    points = [_point(1, "doorbell", 3.0, 100.0, 0.01), _point(1, "polling", 3.0, 100.0, 0.01),
              _point(16, "doorbell", 15.5, 30.0, 0.02), _point(16, "polling", 15.5, 90.0, 0.05),
              _point(1024, "doorbell", high_intake, high_commands, high_cpu),
              _point(1024, "polling", 5.0, 3000.0, 1.0)]
    result = scale.report(points, (1, 16, 1024))
    goals = result["goals"]
    assert (goals["low"], goals["high"]) == (16, 1024)
    assert goals["commands_per_group_high_over_low"] == pytest.approx(high_commands / 30.0)
    assert goals["met"] == met
    rows = {r["measure"]: r for r in result["rows"]}
    polling = rows["N=1024 actor loops: Redis commands per trained group (lower is better), doorbell / polling"]
    assert polling["ratio"]["median"] == pytest.approx(high_commands / 3000.0)
    assert len(rows) == 9  # three figures for each N
