"""Action templates, reward functions and task files: pure functions, no server."""

import asyncio

import pytest

from actors.templates import make_template
from common.config import EnvConfig
from envs import rewards
from envs.rewards import REWARDS, Episode, EpisodeTurn, check_weights
from envs.specs import spec_for
from envs.tasks import read_tasks, task_split, write_task_files


@pytest.mark.parametrize("template, text, action", [
    ("raw", "a\n", "a\n"),
    ("react", "Thought: go.\nAction: go to red ball 1\n", "go to red ball 1"),
    ("react", "Action: turn left\nThought: no, wait\nAction:  move forward \n", "move forward"),  # the last one
    ("react", "Thought: nothing to do", None),
    ("react", "Action:\n", None),
    ("tag", "I think <action>craft 1 stick using 2 planks</action>.", "craft 1 stick using 2 planks"),
    ("tag", "<action></action>", None),
    ("tag", "craft 1 stick", None),
    ("json", 'call: {"action": "search[shoes]"}', "search[shoes]"),
    ("json", '{"name": "calc", "arguments": {"expression": "3*4"}}', "calc 3*4"),
    ("json", '{"name": "answer", "arguments": "12"}', "answer 12"),
    ("json", '{"action": ""}', None),
    ("json", "{not json}", None),
    ("json", "[1, 2]", None),
])
def test_templates_parse_or_refuse(template, text, action):
    assert make_template(template).parse(text) == action


def test_unknown_template_names_the_field():
    with pytest.raises(ValueError, match="actor.action_template"):
        make_template("xml")


def episode(turn_rewards=(0.0, 0.25, 0.5), valid_actions=(False, True, True), **kw) -> Episode:
    turns = [EpisodeTurn("x", "x" if valid else None, "obs", reward, False) for reward, valid in
             zip(turn_rewards, valid_actions, strict=True)]
    base = dict(success=True, generated_tokens=30, token_budget=120, finish_reason="done")
    return Episode(turns=turns, **{**base, **kw})


def combine(weights, episode):
    return asyncio.run(rewards.combine(weights, episode))


def test_each_reward_function():
    ep = episode()
    assert REWARDS["env"](ep) == pytest.approx(0.75)
    assert REWARDS["success"](ep) == 1.0 and REWARDS["success"](episode(success=False)) == 0.0
    assert REWARDS["format"](ep) == pytest.approx(2 / 3)
    assert REWARDS["process"](ep) == pytest.approx(2 / 3)
    assert REWARDS["length"](ep) == pytest.approx(-0.25)
    assert REWARDS["format"](episode(turn_rewards=[], valid_actions=[])) == 0.0
    assert combine({"env": 1.0, "format": 0.3, "length": 0.1}, ep) == pytest.approx(0.75 + 0.2 - 0.025)
    with pytest.raises(ValueError, match="unknown reward functions \\['speed'\\] in actor.rewards"):
        check_weights({"env": 1.0, "speed": 1.0})


def test_progress_reads_the_env_s_last_answer_or_fails_the_group():
    answered = [EpisodeTurn("x", "x", "obs", 0.0, False, {"progress": p}) for p in (0.25, 0.5)]
    unparsed = EpisodeTurn("x", None, "Invalid Action.", 0.0, False)
    base = dict(success=False, generated_tokens=30, token_budget=120, finish_reason="max_turns", env_name="babyai")
    assert REWARDS["progress"](Episode(turns=[*answered, unparsed], **base)) == 0.5
    assert REWARDS["progress"](Episode(turns=[unparsed], **base)) == 0.0
    assert combine({"env": 1.0, "progress": 0.5}, Episode(turns=answered, **base)) == pytest.approx(0.25)
    with pytest.raises(rewards.RewardError, match="babyai does not .* take it out of actor.rewards") as failed:
        combine({"env": 1.0, "progress": 0.5}, episode(env_name="babyai"))
    assert failed.value.reason == "reward_error"


def test_success_rules():
    assert spec_for("babyai").succeeded(True, 0.86, {}) and not spec_for("babyai").succeeded(False, 0.86, {})
    assert spec_for("sciworld").succeeded(False, 1.0, {}) and not spec_for("sciworld").succeeded(True, 0.99, {})
    assert spec_for("letters").succeeded(True, 0.2, {"success": True})  # our envs say so themselves
    assert spec_for("letters").succeeded(True, 1.0, {}) and not spec_for("letters").succeeded(True, 0.5, {})


def test_babyai_clean_action_as_agentgym():
    assert spec_for("babyai").tidy("go to red  ball 1!") == "go to red ball 1"
    assert spec_for("webshop").tidy("click[Buy Now]") == "click[Buy Now]"


def test_task_files_split_without_overlap(tmp_path):
    paths = write_task_files("babyai", tmp_path)
    train, test = read_tasks(paths["train"], "babyai"), read_tasks(paths["test"], "babyai")
    assert len(train) + len(test) == 40_000 and not set(train) & set(test)
    assert min(test) == 36_000  # seeds 900+ of every level are held out
    cfg = EnvConfig(name="babyai", tasks=str(tmp_path))
    got_train, got_test = task_split(cfg)
    assert list(got_train) == train and list(got_test) == test
    with pytest.raises(ValueError, match="not of env.name='textcraft'"):
        task_split(EnvConfig(name="textcraft", tasks=str(tmp_path)))


def test_overlapping_task_files_are_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split, ids in (("train", [0, 1, 2, 3]), ("test", [3, 4])):
        pq.write_table(pa.table({"env": ["letters"] * len(ids), "task_idx": ids, "split": [split] * len(ids)}),
                       tmp_path / f"{split}.parquet")
    with pytest.raises(ValueError, match="1 tasks are in both train and test"):
        task_split(EnvConfig(name="letters", tasks=str(tmp_path)))


def test_default_split_holds_out_the_last_tenth():
    train, test = task_split(EnvConfig(name="letters", num_tasks=1000))
    assert train == range(0, 900) and test == range(900, 1000)
