"""The episodes the learner keeps (learner/samples.py): which it picks, what each turn holds,
and that the file stays bounded."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from learner.batch import collate
from learner.samples import SampleKeeper, as_text, choose, read_samples
from tests.groups import multi_turn_group


def groups(rng, n=3):
    return [multi_turn_group(rng, [([0.1 * g, 0.2 * i], ["a", "b"]) for i in range(4)], version=5) for g in range(n)]


def test_the_best_the_worst_and_distinct_others():
    import random

    rewards = [0.3, 0.9, 0.1, 0.5, 0.5, 0.2]
    picked = choose(rewards, 4, random.Random(0))
    assert picked[:2] == [(1, "best"), (2, "worst")]
    assert len({i for i, _ in picked}) == 4 and [why for _, why in picked[2:]] == ["random", "random"]
    assert choose([1.0], 4, random.Random(0)) == [(0, "best")]
    assert len(choose(rewards, 10, random.Random(0))) == 6  # no more than there are


def test_a_kept_episode_reads_turn_by_turn(tmp_path, tiny_model):
    rng = np.random.default_rng(0)
    batch_groups = groups(rng)
    batch = collate(batch_groups)
    keeper = SampleKeeper(tmp_path, tiny_model, every=10, count=3, max_mb=1.0, seed=0)
    assert not keeper.due(9) and keeper.due(20)
    kept = keeper.keep(20, 19, batch_groups, batch, [2, 0, 1])
    assert [k["why"] for k in kept] == ["best", "worst", "random"]
    assert [k["id"].rsplit("-", 1)[0] for k in kept] == ["20-0", "20-1", "20-2"] and len({k["id"] for k in kept}) == 3
    assert all(k["trained"] for k in kept)  # every group here has signal
    assert read_samples(tmp_path) == json.loads(json.dumps(kept))

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    samples = [(g, s) for g in batch_groups for s in g.samples]
    for episode in kept:
        gi, group = next((i, g) for i, g in enumerate(batch_groups) if g.group_id == episode["group_id"])
        sample = next(s for _g, s in samples if _g is group and float(s.reward) == episode["reward"])
        row = next(i for i, (_g, s) in enumerate(samples) if s is sample)
        assert episode["staleness"] == [2, 0, 1][gi] and episode["weight_version"] == 19
        assert [t["role"] for t in episode["turns"]] == ["prompt", "model", "observation", "model"]
        # The turns put back together are the episode's tokens, each turn's text their decoding.
        assert sum((t["tokens"] for t in episode["turns"]), []) == sample.tokens.tolist()
        assert all(t["text"] == tokenizer.decode(t["tokens"]) for t in episode["turns"])
        assert all(t["pieces"] == [tokenizer.decode([i]) for i in t["tokens"]] for t in episode["turns"])
        model_turns = [t for t in episode["turns"] if t["role"] == "model"]
        mask = sample.loss_mask.astype(bool)
        assert sum((t["logprobs"] for t in model_turns), []) == pytest.approx(sample.logprobs[mask], abs=1e-4)
        assert sum((t["versions"] for t in model_turns), []) == [5] * int(mask.sum())
        advantages = batch.advantages[row, :len(sample.tokens)].numpy()[mask]
        assert sum((t["advantages"] for t in model_turns), []) == pytest.approx(advantages, abs=1e-4)
    assert kept[0]["reward"] == max(s.reward for _g, s in samples)
    assert kept[1]["reward"] == min(s.reward for _g, s in samples)
    # An episode's reward is one of its group's, to the bit (not a float32 of it: 0.2 is not one).
    assert all(k["reward"] in k["group_rewards"] for k in kept) and kept[0]["reward"] not in (0.0, 1.0)
    # A critic over several ranks: this rank knows only its own samples' advantages, so none are kept.
    unknown = keeper.keep(30, 29, batch_groups, batch, [0, 0, 0], advantages_known=False)
    assert all(t["advantages"] is None for k in unknown for t in k["turns"] if t["role"] == "model")
    assert unknown[0]["id"].rsplit("-", 1)[1] != kept[0]["id"].rsplit("-", 1)[1]
    tags = as_text(kept)
    assert list(tags) == ["samples/best", "samples/worst", "samples/random-1"]
    assert tags["samples/best"].startswith(f"**best** · reward {kept[0]['reward']:.3f}")


def test_the_file_is_rotated_and_bounded(tmp_path, tiny_model):
    rng = np.random.default_rng(1)
    keeper = SampleKeeper(tmp_path, tiny_model, every=1, count=4, max_mb=0.01, seed=0)  # 10 KiB
    steps = []
    for step in range(1, 30):
        batch_groups = groups(rng)
        keeper.keep(step, step, batch_groups, collate(batch_groups), [0, 0, 0])
        steps.append(step)
        sizes = [p.stat().st_size for p in tmp_path.glob("samples*.jsonl")]
        assert len(sizes) <= 2 and all(size <= 10 * 1024 for size in sizes)
    assert (tmp_path / "samples.1.jsonl").exists()
    kept_steps = [r["step"] for r in read_samples(tmp_path)]
    assert kept_steps == sorted(kept_steps) and kept_steps[-1] == 29 and kept_steps[0] > 1  # oldest dropped


def test_an_agents_episode_cut_into_segments_is_kept_whole(tmp_path, tiny_model):
    """Issue 29: the learner keeps episodes, not samples: a split episode's segments, in order,
    its reward once, the group's rewards per episode."""
    rng = np.random.default_rng(1)
    group = multi_turn_group(rng, [([1.0], ["a"]), ([0.0], ["a"]), ([0.0], ["b"])], version=5)
    for sample, episode, reward in zip(group.samples, [0, 1, 1], [1.0, 0.0, 0.0]):
        sample.episode, sample.reward = episode, reward
    batch = collate([group])
    kept = SampleKeeper(tmp_path, tiny_model, every=1, count=4, max_mb=1.0, seed=0).keep(1, 1, [group], batch, [0])
    assert [(k["why"], k["reward"], k["segments"]) for k in kept] == [("best", 1.0, 1), ("worst", 0.0, 2)]
    split = kept[1]
    assert split["group_rewards"] == [1.0, 0.0] and split["turn_rewards"] == [0.0, 0.0]
    roles = [t["role"] for t in split["turns"]]
    assert roles.count("prompt") == 2 and roles.count("model") == 2  # each segment starts with its own prompt
