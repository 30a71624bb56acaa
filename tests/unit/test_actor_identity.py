"""What a replica of a scaled actor service derives from its index: seeds and its GPU."""

from actors.worker import actor_seed, gpu_for


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
