"""The record of trained group ids is a bounded window: memory and checkpoints stay flat."""

import torch

from learner.checkpoint import LearnerState, RecentIds, latest_checkpoint, read_checkpoint, save_checkpoint


def test_recent_ids_keep_the_newest_and_forget_the_oldest():
    ids = RecentIds(3, ["a", "b"])
    ids.add(["c", "b", "d"])  # "b" again is not a new entry
    assert ids.to_list() == ["b", "c", "d"] and "a" not in ids and "d" in ids and len(ids) == 3


def test_checkpoints_stay_the_same_size_as_the_run_goes_on(tmp_path):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    window = RecentIds(1000)
    sizes = []
    for step in range(1, 6):
        window.add(f"{step:04d}-{i:032d}" for i in range(800))  # 800 groups a "step": past the window at step 2
        state = LearnerState(step=step, version=step, groups_trained=800 * step, trained_ids=window.to_list())
        sizes.append(save_checkpoint(tmp_path, state, model.state_dict(), optimizer.state_dict(), keep=10).stat().st_size)
    assert sizes[1] == sizes[4]  # flat once the window is full
    restored, model_state, _ = read_checkpoint(latest_checkpoint(tmp_path))
    assert torch.equal(model_state["weight"], model.weight)
    assert restored.groups_trained == 4000 and len(restored.trained_ids) == 1000
    assert restored.trained_ids[-1] == window.to_list()[-1]
