"""What a user extends without editing the package: reward functions that see the whole episode
(sync or async, failing with a reason), an env server's fields as config (env.spec), modules of
their own imported from config (run.plugins), and the defaults a real model brings.

Episodes run through `run_episode` with a scripted policy and the real `letters` env behind an
in-memory client (tests/unit/test_chat.py)."""

import asyncio
import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from actors.episode import EpisodeSetup, run_episode
from actors.templates import make_template
from common.config import REAL_MODEL, ActorConfig, ConfigError, EnvConfig, dump_toml, load_config
from envs.rewards import REWARDS, RewardError, check_weights, register_reward
from envs.specs import spec_for, spec_of
from envs.tasks import task_data
from tests.unit.test_chat import LocalEnvClient, ScriptedPolicy

SEEN = []


@register_reward("test_sees_the_episode")
def sees_the_episode(episode) -> float:
    SEEN.append(episode)
    return 1.0 if episode.turns and episode.turns[-1].action == episode.task.get("answer") else 0.0


@register_reward("test_async_judge")
async def async_judge(episode) -> float:
    await asyncio.sleep(0.01)
    return 0.5 * len(episode.turns)


@register_reward("test_slow_judge")
async def slow_judge(episode) -> float:
    await asyncio.sleep(5)
    return 1.0


@register_reward("test_raises")
def raises(episode) -> float:
    raise KeyError("answer")


@register_reward("test_nan")
def nan(episode) -> float:
    return float("nan")


@register_reward("test_bool")
def boolean(episode) -> bool:
    return episode.success


@pytest.fixture
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def play(tokenizer, rewards: dict[str, float], texts: list[str], task: dict | None = None, timeout_s: float = 60.0):
    """One `letters` episode of task 0 (two turns) where the model writes `texts`, under the tag template."""
    cfg = ActorConfig(max_turns=4, max_tokens=32, max_seq_len=1000, rewards=rewards, reward_timeout_s=timeout_s)
    setup = EpisodeSetup(LocalEnvClient("letters", turns=2), tokenizer, cfg, make_template("tag"), "letters",
                         {0: task} if task else {})
    generations = [(tokenizer.encode(text, add_special_tokens=False), "stop") for text in texts]
    return asyncio.run(run_episode(setup, ScriptedPolicy(generations), task_idx=0))


def test_a_reward_function_sees_the_task_and_every_turn(tokenizer):
    targets = LocalEnvClient("letters", turns=2).env
    targets.reset(0)
    first = targets.targets[0]
    SEEN.clear()
    texts = ["no tag", f"<action>{first}</action>", "<action>z</action>"]  # z: no letter of the alphabet
    sample = play(tokenizer, {"test_sees_the_episode": 1.0, "env": 1.0}, texts, task={"answer": "z"})
    [episode] = SEEN
    assert episode.task == {"answer": "z"} and episode.task_idx == 0 and episode.env_name == "letters"
    assert episode.prompt == f"Say {first}"
    assert [t.text for t in episode.turns] == texts
    assert [t.action for t in episode.turns] == [None, first, "z"]
    assert episode.turns[0].observation.startswith("Invalid Action.") and episode.turns[0].reward == 0.0
    assert episode.turn_rewards == [0.0, 0.5, 0.0] and not episode.success
    assert episode.valid_actions == [False, True, True] and episode.turns[-1].done
    assert episode.turns[-1].info == {"success": False}  # the env's answer fields
    # The last action equals the task file's answer: 1, plus the env's rewards.
    assert sample.reward == pytest.approx(1.0 + 0.5)
    assert sample.invalid_actions == 1 and sample.num_turns == 3


def test_async_and_bool_rewards(tokenizer):
    sample = play(tokenizer, {"test_async_judge": 1.0, "test_bool": 2.0}, ["<action>a</action>"] * 2)
    assert sample.reward == pytest.approx(0.5 * 2 + 2.0 * sample.success)


@pytest.mark.parametrize("name, reason, text", [
    ("test_raises", "reward_error", "reward function 'test_raises' on task 0 failed: KeyError: 'answer'"),
    ("test_nan", "reward_error", "returned nan, not a finite number"),
    ("test_slow_judge", "reward_timeout", "took longer than actor.reward_timeout_s=0.2s"),
])
def test_a_failing_reward_function_fails_the_episode_with_its_reason(tokenizer, name, reason, text):
    with pytest.raises(RewardError) as failed:
        play(tokenizer, {"env": 1.0, name: 1.0}, ["<action>a</action>"] * 2, timeout_s=0.2)
    assert failed.value.reason == reason and text in str(failed.value)


def test_an_unknown_reward_says_where_to_register_it():
    with pytest.raises(ValueError, match=r"unknown reward functions \['speed'\].*run.plugins"):
        check_weights({"env": 1.0, "speed": 1.0})


def test_task_files_carry_columns_the_rewards_see(tmp_path):
    for split, rows in (("train", [(0, "a"), (1, "b")]), ("test", [(2, "c")])):
        pq.write_table(pa.table({"env": ["letters"] * len(rows), "task_idx": [i for i, _ in rows],
                                 "split": [split] * len(rows), "answer": [a for _, a in rows]}),
                       tmp_path / f"{split}.parquet")
    data = task_data(EnvConfig(tasks=str(tmp_path)))
    assert data == {0: {"answer": "a"}, 1: {"answer": "b"}, 2: {"answer": "c"}}
    assert task_data(EnvConfig()) == {}


def test_env_spec_overrides_what_we_know_of_a_server():
    cfg = load_config(None, ['env.name="my_server"', 'env.spec.task_field="game"', 'env.spec.reward_field="score"',
                             "env.spec.reward_is_total=true", 'env.spec.success="done"', "env.spec.create_body={}",
                             'env.spec.reset_extra={world_type = "Text"}', "env.spec.num_tasks=50"], environ={})
    spec = spec_of(cfg.env)
    assert (spec.task_field, spec.reward_field, spec.reward_is_total, spec.success, spec.create_body) == \
        ("game", "score", True, "done", {})
    assert spec.reset_body(7) == {"game": 7, "world_type": "Text"} and spec.split() == (range(0, 45), range(45, 50))
    assert spec_of(cfg.env, "babyai") == spec_for("babyai")  # another env keeps its own
    # A known env keeps what env.spec leaves unset.
    sci = spec_of(load_config(None, ['env.name="sciworld"', "env.spec.reward_scale=0.1"], environ={}).env)
    assert sci.reward_scale == 0.1 and sci.reward_field == "score" and sci.reset_prefix == "task_description"
    # The resolved config (what `omrl run` hands its processes) loads back the same.
    again = load_config_text(dump_toml(cfg))
    assert spec_of(again.env) == spec
    with pytest.raises(ConfigError, match="env.spec.success: Input should be 'field', 'done' or 'full_reward'"):
        load_config(None, ['env.spec.success="always"'], environ={})


def test_a_refused_observation_is_the_specs_pattern_from_its_start():
    from deploy.preflight import Failed, check_refused

    textcraft = spec_for("textcraft")
    assert textcraft.refuses("Could not find dirt block") and not textcraft.refuses("Got 1 dirt block (Could not)")
    assert not spec_for("letters").refuses("Could not find dirt block")  # names no pattern
    cfg = load_config(None, ['env.name="my_server"', 'env.spec.refused="Nothing happens|You can.t"'], environ={})
    assert spec_of(cfg.env).refuses("You can't do that") and not spec_of(cfg.env).refuses("Done. You can go")
    check_refused(cfg)
    with pytest.raises(Failed, match=r"env.spec.refused = '\(' is not a regular expression"):
        check_refused(load_config(None, ['env.spec.refused="("'], environ={}))
    with pytest.raises(Failed, match="learner.refused_unlikelihood = 0.5, but env 'letters'") as failed:
        check_refused(load_config(None, ["learner.refused_unlikelihood=0.5"], environ={}))
    assert "learner.refused_unlikelihood = 0" in failed.value.fix


def load_config_text(text: str):
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(text)
        f.flush()
        return load_config(f.name, environ={})


def test_plugins_are_imported_before_anything_checks(tmp_path, monkeypatch):
    (tmp_path / "my_ext.py").write_text(
        "from envs.rewards import register_reward\n\n"
        "@register_reward('my_ext_reward')\n"
        "def mine(episode):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ['run.plugins=["my_ext"]', "actor.rewards={my_ext_reward = 1.0}"], environ={})
    assert "my_ext" in sys.modules and "my_ext_reward" in REWARDS
    check_weights(cfg.actor.rewards)
    load_config(None, ['run.plugins=["my_ext"]'], environ={})  # imported once: nothing registered twice
    with pytest.raises(ConfigError, match=r"run.plugins: cannot import 'no_such_ext' \(ModuleNotFoundError: .*"
                                          r"PYTHONPATH"):
        load_config(None, ['run.plugins=["no_such_ext"]'], environ={})
    (tmp_path / "broken_ext.py").write_text("raise RuntimeError('needs JUDGE_URL')\n")
    with pytest.raises(ConfigError, match=r"cannot import 'broken_ext' \(RuntimeError: needs JUDGE_URL\)"):
        load_config(None, ['run.plugins=["broken_ext"]'], environ={})


def real_model(path, chat: bool, **config):
    """A model directory's JSON files in the shape of Qwen2.5-0.5B-Instruct (no weights: the defaults
    read only the JSON)."""
    path.mkdir()
    hf = {"hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936, "num_attention_heads": 14,
          "num_key_value_heads": 2, "intermediate_size": 4864, "tie_word_embeddings": True,
          "max_position_embeddings": 32768, "torch_dtype": "bfloat16", **config}
    (path / "config.json").write_text(json.dumps(hf))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"} if chat else {}))
    return str(path)


def test_defaults_follow_the_model(tmp_path, tiny_model):
    chat = load_config(None, [f"model.path={json.dumps(real_model(tmp_path / 'chat', True))}"], environ={})
    assert (chat.actor.max_tokens, chat.actor.max_seq_len, chat.learner.lr, chat.learner.entropy_coef,
            chat.learner.checkpoint_every, chat.learner.gradient_checkpointing) == tuple(REAL_MODEL.values())
    # A checkpoint every 10 steps: the streams hold the 2 x 10 x groups_per_step groups that can wait for one.
    assert chat.redis.max_stream_len == 2 * 10 * chat.learner.groups_per_step
    fewer = load_config(None, [f"model.path={json.dumps(str(tmp_path / 'chat'))}", "learner.groups_per_step=3",
                               "learner.checkpoint_every=4", "redis.shards=2"], environ={})
    assert fewer.redis.max_stream_len == 16  # 2 x 4 x 3 over 2 shards is 12: the default 16 holds them
    assert load_config(None, [f"model.path={json.dumps(str(tmp_path / 'chat'))}", "redis.max_stream_len=500"],
                       environ={}).redis.max_stream_len == 500
    assert chat.actor.stop == [] and chat.model.dtype == "bfloat16"  # stops at its end of turn
    # A base model (no chat template): the template's stop; a short context caps max_seq_len.
    base = load_config(None, [f"model.path={json.dumps(real_model(tmp_path / 'base', False, max_position_embeddings=2048))}",
                              'actor.action_template="react"'], environ={})
    assert base.actor.stop == ["\nObservation:"] and base.actor.max_seq_len == 2048 and base.learner.lr == 1e-6
    assert make_template("react").parse("Thought: go.\nAction: go to red ball 1\nObservation:") == "go to red ball 1"
    # What the config says wins, wherever it says it.
    mine = load_config(None, [f"model.path={json.dumps(str(tmp_path / 'chat'))}", "learner.lr=1e-5", 'actor.stop=["\\n"]'],
                       environ={"OMRL_ACTOR__MAX_TOKENS": "64"})
    assert (mine.learner.lr, mine.actor.stop, mine.actor.max_tokens) == (1e-5, ["\n"], 64)
    # The tiny model and an unset model keep the tiny defaults (the CPU runs as measured).
    for overrides in ([f"model.path={json.dumps(tiny_model)}"], []):
        tiny = load_config(None, overrides, environ={})
        assert (tiny.actor.max_tokens, tiny.actor.stop, tiny.learner.lr, tiny.learner.entropy_coef) == \
            (4, ["\n"], 2.5e-4, 0.01)
        assert (tiny.learner.checkpoint_every, tiny.redis.max_stream_len) == (1, 16)
