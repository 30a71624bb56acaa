"""What a replica of a scaled actor service derives from its index: seeds and its GPU."""

from actors.worker import actor_seed
from common.config import Config
from common.gpus import evaluator_devices, evaluator_gpus, gpu_for


def test_seeds_are_distinct_across_indexes_and_restarts():
    assert [actor_seed(7, i, 0) for i in range(3)] == [7, 8, 9]  # first starts: seed + index
    seeds = {actor_seed(7, i, s) for i in range(50) for s in range(20)}
    assert len(seeds) == 50 * 20
    assert actor_seed(7, 3, 2) == actor_seed(7, 3, 2) and 0 <= actor_seed(7, 3, 2) < 2**31


def test_replicas_spread_over_the_gpus_the_learner_leaves():
    eight = [str(i) for i in range(8)]
    assert [gpu_for(i, 4, eight) for i in range(6)] == ["4", "5", "6", "7", "4", "5"]
    assert [gpu_for(i, 1, ["2", "5", "6"]) for i in range(3)] == ["5", "6", "5"]
    assert gpu_for(3, 1, ["0"]) == "0"  # one GPU for all: shared with the learner


def test_the_evaluator_gets_gpus_of_its_own_or_none(monkeypatch):
    eight = [str(i) for i in range(8)]
    assert evaluator_gpus(4, 3, 1, eight) == ["7"]  # after the learner's 4 and the 3 actors'
    assert evaluator_gpus(4, 4, 1, eight) is None  # every GPU has an actor
    assert evaluator_gpus(1, 1, 1, ["2", "5", "6"]) == ["6"]
    assert evaluator_gpus(1, 2, 1, ["0", "1"]) is None and evaluator_gpus(1, 1, 1, ["0"]) is None
    assert evaluator_gpus(2, 2, 2, eight) == ["6", "7"] and evaluator_gpus(2, 2, 3, eight) is None  # tensor parallel
    # Actors without actor.gpu_by_index all use the first GPU: the one after the actors' count is free too.
    assert evaluator_gpus(1, 2, 1, eight) == ["3"] and all(gpu_for(i, 1, eight) != "3" for i in range(2))

    cfg = Config.model_validate({"learner": {"ranks": 1}, "actor": {"num_actors": 2}})  # learner.device "auto"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert evaluator_devices(cfg) == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert evaluator_devices(cfg) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: the CPU, nothing to narrow
    assert evaluator_devices(cfg) == ""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert evaluator_devices(cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"device": "cpu"})})) == ""
