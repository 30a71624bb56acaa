"""The record of trained group ids is a bounded window: memory and checkpoints stay flat.
A checkpoint is a directory that is whole or absent."""

import pytest
import torch

from learner.checkpoint import (
    LearnerState,
    RecentIds,
    begin,
    checkpoints,
    finish,
    latest_checkpoint,
    read_model,
    read_state,
    save_shards,
)


def test_recent_ids_keep_the_newest_and_forget_the_oldest():
    ids = RecentIds(3, ["a", "b"])
    ids.add(["c", "b", "d"])  # "b" again is not a new entry
    assert ids.to_list() == ["b", "c", "d"] and "a" not in ids and "d" in ids and len(ids) == 3


def test_staleness_is_counted_in_optimizer_steps_across_a_restart(tmp_path):
    state = LearnerState()
    state.published_now(keep=4)  # version 0: step 0's weights
    for step in range(1, 7):  # publish_every = 2
        state.step = step
        if step % 2 == 0:
            state.version += 1
            state.published_now(keep=4)
    assert state.published == [[0, 0], [1, 2], [2, 4], [3, 6]]
    assert [state.steps_behind(v) for v in (0, 1, 2, 3, -1)] == [6, 4, 2, 0, 0]
    # Checkpointed, restarted; weights newer than the checkpoint had been published (version 4, step
    # 8) before the crash: the new learner publishes its weights as version 5, still at step 6.
    state = read_state(save(tmp_path, state, torch.nn.Linear(2, 2), keep=1))
    state.version = 5
    state.published_now(keep=4)
    state.step = 7
    assert state.published == [[1, 2], [2, 4], [3, 6], [5, 6]]  # the oldest beyond `keep` forgotten
    assert [state.steps_behind(v) for v in (5, 3, 1)] == [1, 1, 5]
    assert state.steps_behind(4) == 0  # the lost version: newer than the checkpoint's weights...
    assert not state.fresh(4) and not state.fresh(5) and state.fresh(-1)  # ...but not the weights now
    assert state.steps_behind(0) == 5  # older than every version kept: at least the oldest's
    state.step = 6
    assert state.fresh(5) and state.fresh(3) and not state.fresh(2)  # 5 and 3 hold step 6's weights


def save(directory, state: LearnerState, module: torch.nn.Module, keep: int):
    path = begin(directory, state.step)
    save_shards({"model": module.state_dict()}, path, group=None, background=False)
    return finish(path, state, keep)


def test_checkpoints_stay_the_same_size_as_the_run_goes_on(tmp_path):
    model = torch.nn.Linear(4, 4)
    window = RecentIds(1000)
    sizes = []
    for step in range(1, 6):
        window.add(f"{step:04d}-{i:032d}" for i in range(800))  # 800 groups a "step": past the window at step 2
        state = LearnerState(step=step, version=step, groups_trained=800 * step, trained_ids=window.to_list())
        sizes.append(sum(f.stat().st_size for f in save(tmp_path, state, model, keep=10).iterdir()))
    assert sizes[1] == sizes[4]  # flat once the window is full
    newest = latest_checkpoint(tmp_path)
    restored = read_state(newest)
    assert torch.equal(read_model(newest)["weight"], model.weight)
    assert restored.groups_trained == 4000 and len(restored.trained_ids) == 1000
    assert restored.trained_ids[-1] == window.to_list()[-1]


def test_only_a_finished_checkpoint_counts_and_the_oldest_go(tmp_path):
    model = torch.nn.Linear(4, 4)
    for step in (1, 2, 3):
        save(tmp_path, LearnerState(step=step, version=step), model, keep=2)
    assert [p.name for p in checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    # A crash in the middle of step 4's write leaves its shards but not the learner's state: not a checkpoint.
    path = begin(tmp_path, 4)
    save_shards({"model": model.state_dict()}, path, group=None, background=False)
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    assert read_state(latest_checkpoint(tmp_path)) == LearnerState(step=3, version=3)
    assert not any(begin(tmp_path, 4).iterdir())  # written again from empty
    with torch.no_grad():
        model.weight.add_(1.0)
    assert read_state(save(tmp_path, LearnerState(step=4, version=4), model, keep=2)).step == 4
    assert torch.equal(read_model(latest_checkpoint(tmp_path))["weight"], model.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]  # no .tmp left


def test_a_checkpoint_of_the_older_one_file_format_is_refused_naming_the_fix(tmp_path):
    torch.save({"format": 2}, tmp_path / "step-00000007.pt")
    with pytest.raises(SystemExit, match="older learner .*start a new run dir"):
        latest_checkpoint(tmp_path)
