"""The learner puts one evaluation in each step record: of those arrived (several evaluators may
finish within one step), the one of the lowest version first; none is dropped."""

from types import SimpleNamespace

from learner.worker import Learner


def test_each_step_record_takes_the_lowest_version_arrived_and_drops_none():
    learner, bridge = SimpleNamespace(evals=[]), SimpleNamespace(evals=[])
    assert Learner._evals(learner, bridge) == {}
    bridge.evals += [{"version": 60, "success": 0.5}, {"version": 40, "success": 0.25}]
    assert Learner._evals(learner, bridge) == {"eval/version": 40, "eval/success": 0.25}
    bridge.evals.append({"version": 80, "success": 0.75})
    assert Learner._evals(learner, bridge)["eval/version"] == 60
    assert Learner._evals(learner, bridge)["eval/version"] == 80
    assert Learner._evals(learner, bridge) == {} and bridge.evals == []
