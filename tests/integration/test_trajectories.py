"""`omrl collect` through the CLI against real env servers: the oracle's episodes re-tokenise to
exactly the tokens the actors would have seen (the file's conversation, tokenised again, and a
policy that generates the file's agent tokens, played through the actors' episode loop against
the env server, give the file's tokens and masks), for BabyAI with a word tokenizer built from
its text and for the letters env with the character tokenizer in plain-text format."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from actors.chat import make_format
from actors.engine import Generation
from actors.episode import EpisodeSetup, Turn, run_episode
from actors.evaluate import ServerPolicy
from actors.templates import make_template
from actors.trajectories import collect, read_episodes, tokenize
from common.config import ActorConfig
from envs.client import EnvClient
from envs.specs import spec_for
from tests.servers import env_server_process


def omrl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


class Replay:
    """A policy that generates, turn by turn, the agent tokens of a recorded episode, after
    checking that the context it is given is the recorded one so far."""

    def __init__(self, tokens: list[int], mask: list[int]):
        self.tokens, self.mask = tokens, mask

    async def act(self, tokens: list[int], budget: int, env_id: int) -> Turn:
        start = len(tokens)
        assert tokens == self.tokens[:start], "the context differs from the recorded one"
        end = start
        while end < len(self.mask) and self.mask[end]:
            end += 1
        assert end > start, "the recording has no agent turn here"
        ids = self.tokens[start:end]
        return Turn(Generation(ids, [0.0] * len(ids), "stop"), 0)


async def replay(url: str, env: str, tokenizer, actor: ActorConfig, rows: list[dict]) -> list:
    async with aiohttp.ClientSession() as session:
        setup = EpisodeSetup(EnvClient(url, session, 60, spec_for(env)), tokenizer, actor, make_template("raw"), env)
        return [await run_episode(setup, Replay(r["tokens"], r["loss_mask"]), r["task_idx"]) for r in rows]


@pytest.mark.parametrize("env, settings", [
    pytest.param("babyai", ["actor.max_turns=10", "actor.max_tokens=16", "actor.max_seq_len=2048"],
                 marks=pytest.mark.babyai, id="babyai-word-chat"),
    pytest.param("letters", ["actor.chat_template=\"none\""], id="letters-char-plain"),
])
def test_collected_episodes_retokenise_to_the_actors_tokens(tmp_path, env, settings):
    if env == "babyai":
        pytest.importorskip("minigrid", reason="the babyai extra is not installed")
        model = omrl("init-model", str(tmp_path / "model"), "--tokenizer", "word", "--env", env,
                     "--env-episodes", "40").stdout.strip().splitlines()[-1]
    else:
        model = omrl("init-model", str(tmp_path / "model")).stdout.strip().splitlines()[-1]
    out = tmp_path / "episodes.parquet"
    sets = [arg for s in settings for arg in ("--set", s)]
    omrl("collect", "--env", env, "--episodes", "24", "--out", str(out), "--model", model, *sets)
    rows = read_episodes(out)
    assert len(rows) == 24 and all(r["policy"] == "oracle" for r in rows) and sum(r["success"] for r in rows) >= 12

    from transformers import AutoTokenizer

    from common.config import load_config

    cfg = load_config(None, settings)
    tokenizer = AutoTokenizer.from_pretrained(model)
    fmt = make_format(tokenizer, cfg.actor.chat_template, cfg.actor.stop)
    for r in rows:
        assert tokenize(fmt, r["conversations"]) == (r["tokens"], r["loss_mask"])
        agent = [t for t, m in zip(r["tokens"], r["loss_mask"]) if m]
        gpt = [turn["value"] for turn in r["conversations"] if turn["from"] == "gpt"]
        assert tokenizer.decode(agent) == "".join(g + "\n" for g in gpt)  # each action and its line break

    with env_server_process(env) as url:
        samples = asyncio.run(replay(url, env, tokenizer, cfg.actor, rows))
    for r, s in zip(rows, samples):
        assert s.tokens.tolist() == r["tokens"] and s.loss_mask.tolist() == r["loss_mask"]
        assert s.success == r["success"] and s.num_turns == r["num_turns"]


def test_import_trajectories_writes_a_file_sft_reads(tmp_path):
    source = tmp_path / "agentgym.json"
    source.write_text(json.dumps([{"item_id": "letters_3", "conversations": [
        {"from": "human", "loss": None, "value": "Say a"}, {"from": "gpt", "loss": True, "value": "a"},
        {"from": "human", "loss": None, "value": "\nSay b"}, {"from": "gpt", "loss": True, "value": "b"}]}]))
    out = tmp_path / "imported.parquet"
    assert omrl("import-trajectories", str(source), "--out", str(out)).stdout.strip().endswith("imported.parquet")
    [row] = read_episodes(out)
    assert (row["env"], row["task_idx"], row["policy"]) == ("letters", 3, "imported")
    assert sum(row["loss_mask"]) == 4  # "a\n" and "b\n" with the character tokenizer
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "a"}]}]))
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "import-trajectories", str(bad), "--out",
                           str(tmp_path / "x.parquet")], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "record 0" in done.stderr and not (tmp_path / "x.parquet").exists()


async def noisy_collect(url: str, tokenizer, actor: ActorConfig, seed: int, concurrency: int) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        setup = EpisodeSetup(EnvClient(url, session, 60, spec_for("letters")), tokenizer, actor, make_template("raw"),
                             "letters")
        return await collect(setup, ServerPolicy(setup, "oracle", 0.5, seed), "oracle", range(24), concurrency)


def test_a_noisy_collect_is_the_same_whatever_order_its_episodes_take_turns_in(tmp_path):
    """The same seed gives the same episodes, played one at a time or 24 at once (their draws
    from one shared generator would come in another order), and another seed other ones."""
    from transformers import AutoTokenizer

    from common.config import load_config

    model = omrl("init-model", str(tmp_path / "model")).stdout.strip().splitlines()[-1]
    tokenizer = AutoTokenizer.from_pretrained(model)
    actor = load_config(None, ["actor.chat_template=\"none\""]).actor
    with env_server_process("letters") as url:
        one_by_one, at_once, other = [asyncio.run(noisy_collect(url, tokenizer, actor, seed, concurrency))
                                      for seed, concurrency in ((3, 1), (3, 24), (4, 24))]
    conversations = [[r["conversations"] for r in rows] for rows in (one_by_one, at_once, other)]
    assert any(not turn["loss"] for c in conversations[0] for turn in c if turn["from"] == "gpt")
    assert conversations[0] == conversations[1]
    assert conversations[0] != conversations[2]


class Says:
    """A policy that always writes the same action (a model's mistakes, without an engine)."""

    def __init__(self, setup: EpisodeSetup, text: str):
        self.ids = setup.format.agent_turn(text)

    async def act(self, tokens: list[int], budget: int, env_id: int, stops=None, choices=None) -> Turn:
        return Turn(Generation(self.ids, [-1.0] * len(self.ids), "stop"), 0)


async def dagger_collect(url: str, tokenizer, actor: ActorConfig) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        setup = EpisodeSetup(EnvClient(url, session, 60, spec_for("letters")), tokenizer, actor, make_template("raw"),
                             "letters")
        return await collect(setup, ServerPolicy(setup, "oracle", 0.5, 3, mistakes=Says(setup, "q")), "oracle",
                             range(24))


def test_a_policy_s_own_turns_as_the_mistakes_are_context_and_the_oracle_s_label_what_follows(tmp_path):
    """`omrl collect --mistakes model` (DAgger's data): the other policy plays the noisy turns
    (its tokens are in the episode as it generated them, and the env answered them) outside the
    loss; the oracle plays the rest, from the states they left, inside it."""
    from transformers import AutoTokenizer

    from common.config import load_config

    model = omrl("init-model", str(tmp_path / "model")).stdout.strip().splitlines()[-1]
    tokenizer = AutoTokenizer.from_pretrained(model)
    actor = load_config(None, ["actor.chat_template=\"none\""]).actor
    with env_server_process("letters") as url:
        rows = asyncio.run(dagger_collect(url, tokenizer, actor))
    fmt = make_format(tokenizer, actor.chat_template, actor.stop)
    gpt = [turn for r in rows for turn in r["conversations"] if turn["from"] == "gpt"]
    assert 0.25 * len(gpt) < sum(turn["value"].strip() == "q" for turn in gpt) < 0.75 * len(gpt), len(gpt)
    assert all(turn["loss"] == (turn["value"].strip() != "q") for turn in gpt)
    for r in rows:  # the trained tokens are the oracle's turns, as the format writes them
        trained = [turn for turn in r["conversations"] if turn["from"] == "gpt" and turn["loss"]]
        assert [t for t, m in zip(r["tokens"], r["loss_mask"]) if m] == [
            t for turn in trained for t in fmt.agent_turn(turn["value"])]
    after_q = [c[k + 2] for r in rows for c in [r["conversations"]] for k, turn in enumerate(c[:-2])
               if turn["from"] == "gpt" and not turn["loss"] and c[k + 2]["loss"]]
    assert after_q and all(turn["value"] in "abcd" for turn in after_q)  # the oracle's labels of the states q left
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "collect", "--env", "letters", "--episodes", "2", "--out",
                           str(tmp_path / "x.parquet"), "--mistakes", "model"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "--mistakes model needs --policy oracle, --model" in done.stderr


def test_a_noisy_oracle_leaves_its_random_turns_out_of_the_loss(tmp_path):
    """`omrl collect --noise`: some turns are the random policy's, in the episode as context but
    outside the loss mask, and the file still re-tokenises to its own tokens and mask."""
    model = omrl("init-model", str(tmp_path / "model")).stdout.strip().splitlines()[-1]
    out = tmp_path / "noisy.parquet"
    settings = ["actor.chat_template=\"none\""]
    omrl("collect", "--env", "letters", "--episodes", "24", "--out", str(out), "--model", model, "--noise", "0.5",
         "--seed", "3", "--set", settings[0])
    rows = read_episodes(out)
    gpt = [turn for r in rows for turn in r["conversations"] if turn["from"] == "gpt"]
    untrained = [turn for turn in gpt if not turn["loss"]]
    assert 0.25 * len(gpt) < len(untrained) < 0.75 * len(gpt), (len(untrained), len(gpt))

    from transformers import AutoTokenizer

    from common.config import load_config

    cfg = load_config(None, settings)
    fmt = make_format(AutoTokenizer.from_pretrained(model), cfg.actor.chat_template, cfg.actor.stop)
    for r in rows:
        assert tokenize(fmt, r["conversations"]) == (r["tokens"], r["loss_mask"])
        trained = [turn for turn in r["conversations"] if turn["from"] == "gpt" and turn["loss"]]
        assert sum(r["loss_mask"]) == sum(len(fmt.agent_turn(turn["value"])) for turn in trained)
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "collect", "--env", "letters", "--episodes", "2", "--out",
                           str(tmp_path / "x.parquet"), "--noise", "1.5"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "noise must be in [0, 1)" in done.stderr
