"""Chat templates in the episode loop: an episode's tokens are the template's render of its
conversation, generated tokens exactly as sampled (mask 1), everything else mask 0.

Episodes run through `run_episode` with a scripted policy and the real `letters` env behind an
in-memory client; tokenizers are the tiny model's (saved and loaded back) and a ChatML one built
here. Nothing is downloaded."""

import asyncio
import copy
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from actors.chat import ChatFormat, PlainFormat, make_format
from actors.engine import Generation
from actors.episode import EpisodeSetup, Turn, run_episode
from actors.templates import make_template
from common.config import ActorConfig
from common.models import TINY_CHAT_TEMPLATE, TURNS_CHAT_TEMPLATE, build_char_tokenizer
from envs.base import StepResult, make_env
from envs.specs import spec_for

CHATML = ("{% for message in messages %}"  # Qwen's ChatML, without its default system message
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SYSTEM = "Play.\nWrite your action between <action> and </action>."  # system_prompt, the tag template's instructions


class LocalEnvClient:
    """The env client's interface over a real env in this process (no server)."""

    def __init__(self, name: str, **options):
        self.env, self.spec = make_env(name, **options), spec_for(name)

    async def create(self) -> int:
        return 0

    async def reset(self, env_id, task_idx):
        return StepResult(self.env.reset(task_idx), 0.0, False)

    async def step(self, env_id, action):
        return self.env.step(action)

    async def start(self, task_idx):
        return 0, await self.reset(0, task_idx)

    async def finish(self, env_id, in_order) -> None:
        pass


class ScriptedPolicy:
    """Each turn generates the next scripted token ids (log-prob -0.5, version 3)."""

    def __init__(self, generations: list[tuple[list[int], str]]):
        self.generations, self.seen = list(generations), []

    async def act(self, tokens, budget, env_id):
        self.seen.append(list(tokens))
        ids, finish = self.generations.pop(0)
        return Turn(Generation(ids, [-0.5] * len(ids), finish), version=3)


@pytest.fixture
def tiny_tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)  # the template as init_tiny_model saved it


def chatml_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def end_of_turn(tokenizer) -> list[int]:
    """What the model samples to end its turn: the stop "\\n" (tiny), <|im_end|> (ChatML)."""
    return tokenizer.encode("<|im_end|>" if "<|im_end|>" in tokenizer.get_vocab() else "\n", add_special_tokens=False)


def episode(tokenizer, generations, turns=3, max_turns=4, chat_template="auto", system_prompt="Play.\n"):
    cfg = ActorConfig(max_turns=max_turns, max_tokens=32, max_seq_len=1000, system_prompt=system_prompt,
                      chat_template=chat_template)
    setup = EpisodeSetup(LocalEnvClient("letters", turns=turns), tokenizer, cfg, make_template("tag"), "letters")
    policy = ScriptedPolicy(generations)
    return asyncio.run(run_episode(setup, policy, task_idx=0)), policy, setup


def runs(sample) -> list[tuple[bool, list[int]]]:
    """The sample cut into runs of generated (True) and context (False) tokens."""
    gen, out, start = sample.loss_mask.astype(bool), [], 0
    for i in range(1, len(sample.tokens) + 1):
        if i == len(sample.tokens) or gen[i] != gen[start]:
            out.append((bool(gen[start]), sample.tokens[start:i].tolist()))
            start = i
    return out


def letters_of(task_idx: int, turns: int) -> list[str]:
    env = make_env("letters", turns=turns)
    env.reset(task_idx)
    return list(env.targets)


def turns_tokenizer(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = TURNS_CHAT_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("which", ["tiny", "turns", "chatml"])
@pytest.mark.parametrize("ending", ["done", "max_turns"])
def test_episode_equals_the_template_render_of_its_conversation(which, ending, tiny_tokenizer):
    tokenizer = {"tiny": lambda: tiny_tokenizer, "turns": lambda: turns_tokenizer(tiny_tokenizer),
                 "chatml": chatml_tokenizer}[which]()
    turns, max_turns = (3, 4) if ending == "done" else (3, 2)
    texts = [f"<action>{x}</action>" for x in letters_of(0, turns)]
    generated = [tokenizer.encode(t, add_special_tokens=False) + end_of_turn(tokenizer) for t in texts]
    sample, policy, setup = episode(tokenizer, [(ids, "stop") for ids in generated], turns, max_turns)
    assert sample.finish_reason == ending and sample.num_turns == min(turns, max_turns)
    assert isinstance(setup.format, ChatFormat)

    # The same conversation, rendered whole by the template.
    env = make_env("letters", turns=turns)
    observations = [env.reset(0)] + [env.step(x).observation for x in letters_of(0, turns)]
    messages = [{"role": "system", "content": SYSTEM}]
    for obs, text in zip(observations, texts[:sample.num_turns]):
        messages += [{"role": "user", "content": obs}, {"role": "assistant", "content": text}]
    if ending == "done":
        full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        # The episode ends at the last generation: the final assistant suffix beyond what the
        # model generated (ChatML's "\n" after <|im_end|>; nothing for the tiny template) is
        # the template's, not the episode's, so it is left out of the comparison.
        tail = setup.format.assistant_suffix[len(end_of_turn(tokenizer)):]
        assert full[len(sample.tokens):] == tail
        full = full[:len(sample.tokens)]
    else:  # cut by max_turns after the next user turn and the generation prompt
        messages.append({"role": "user", "content": observations[sample.num_turns]})
        full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert sample.tokens.tolist() == full

    # Masks: exactly the generated tokens are mask 1, with their log-probs and version.
    pieces = runs(sample)
    assert [ids for is_gen, ids in pieces if is_gen] == generated[:sample.num_turns]
    assert [is_gen for is_gen, _ in pieces] == [False, True] * sample.num_turns + ([False] if ending != "done" else [])
    gen = sample.loss_mask.astype(bool)
    assert np.all(sample.logprobs[gen] == -0.5) and np.all(sample.logprobs[~gen] == 0)
    assert set(sample.versions[gen].tolist()) == {3} and set(sample.versions[~gen].tolist()) == {-1}
    # The policy saw the buffer as it grew: each call's tokens are a prefix of the episode's.
    for seen in policy.seen:
        assert sample.tokens[:len(seen)].tolist() == seen
    assert sample.success == (ending == "done")


def test_the_tiny_template_renders_role_markers_and_ends_prompts_with_the_observation(tiny_tokenizer):
    assert tiny_tokenizer.chat_template == TINY_CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Say a"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "Say b"}]
    ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tiny_tokenizer.decode(ids) == "S: Play.\nU: Say aa\nU: Say b"
    chat = ChatFormat(tiny_tokenizer)
    assert chat.assistant_suffix == tiny_tokenizer.encode("\n", add_special_tokens=False)  # the actors' stop
    assert chat.next_turn(tiny_tokenizer.encode("a\n", add_special_tokens=False), "Say b") == \
        tiny_tokenizer.encode("U: Say b", add_special_tokens=False)


def test_the_turns_template_marks_each_turn_and_prompts_the_answer(tiny_tokenizer):
    """`omrl init-model --template turns` (the TextCraft demo's): an observation that ends like
    an action ("Could not execute get") is still followed by the answer's own marker."""
    tokenizer = turns_tokenizer(tiny_tokenizer)
    messages = [{"role": "user", "content": "Goal: a"}, {"role": "assistant", "content": "get"},
                {"role": "user", "content": "Could not execute get"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == "U: Goal: a\nA: get\nU: Could not execute get\nA: "
    chat = ChatFormat(tokenizer)
    assert chat.assistant_suffix == tokenizer.encode("\n", add_special_tokens=False)  # where the model stops
    assert chat.next_turn(tokenizer.encode("get\n", add_special_tokens=False), "Could not execute get") == \
        tokenizer.encode("U: Could not execute get\nA: ", add_special_tokens=False)


@pytest.mark.parametrize("which", ["tiny", "chatml"])
def test_a_generation_cut_by_length_gets_the_whole_suffix_as_context(which, tiny_tokenizer):
    tokenizer = tiny_tokenizer if which == "tiny" else chatml_tokenizer()
    [letter] = letters_of(0, 1)
    cut = tokenizer.encode("<action>", add_special_tokens=False)  # no end-of-turn token
    rest = [(tokenizer.encode(f"<action>{letter}</action>", add_special_tokens=False) + end_of_turn(tokenizer), "stop")]
    sample, _, setup = episode(tokenizer, [(cut, "length")] + rest, turns=1)
    pieces = runs(sample)
    assert pieces[1] == (True, cut)
    suffix = setup.format.assistant_suffix
    assert len(suffix) == (2 if which == "chatml" else 1)
    assert tokenizer.decode(suffix) == ("<|im_end|>\n" if which == "chatml" else "\n")
    is_gen, context = pieces[2]
    assert not is_gen and context[:len(suffix)] == suffix  # all of it, mask 0
    user_turn = f"U: Invalid Action.\n\nSay {letter}" if which == "tiny" else \
        f"<|im_start|>user\nInvalid Action.\n\nSay {letter}<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(context[len(suffix):]) == user_turn  # the cut text did not parse
    assert sample.invalid_actions == 1 and sample.finish_reason == "done"


def plain_expectation(tokenizer, generated: list[list[int]]) -> list[int]:
    """Plain text as before chat templates: system text and first observation, then each
    generation followed by the next observation."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    env = make_env("letters", turns=3)
    tokens = encode("Play.\nWrite your action between <action> and </action>.\n" + env.reset(0))
    for ids, letter in zip(generated, letters_of(0, 3)):
        observation = env.step(letter).observation
        tokens += ids + ([] if env.turn == 3 else encode(observation))
    return tokens


@pytest.mark.parametrize("case", ["chat_template=none", "no template"])
def test_plain_rendering_without_a_template(case, tiny_tokenizer):
    tokenizer, chat_template = (tiny_tokenizer, "none") if case == "chat_template=none" else \
        (build_char_tokenizer(), "auto")
    generated = [tokenizer.encode(f"<action>{x}</action>\n", add_special_tokens=False) for x in letters_of(0, 3)]
    sample, _, setup = episode(tokenizer, [(ids, "stop") for ids in generated], chat_template=chat_template)
    assert isinstance(setup.format, PlainFormat) and sample.finish_reason == "done"
    assert sample.tokens.tolist() == plain_expectation(tokenizer, generated)
    assert [ids for is_gen, ids in runs(sample) if is_gen] == generated


def test_the_appended_turn_counts_against_the_context_window(tiny_tokenizer):
    generated = tiny_tokenizer.encode("<action>a</action>\n", add_special_tokens=False)
    cfg = ActorConfig(max_turns=4, max_tokens=32, max_seq_len=34, system_prompt="", chat_template="auto")
    setup = EpisodeSetup(LocalEnvClient("letters", turns=3), tiny_tokenizer, cfg, make_template("raw"), "letters")
    first = setup.format.first_prompt(setup.system, "Say a")
    next_turn = setup.format.next_turn(generated, "\nSay b")
    assert len(first) + len(generated) < cfg.max_seq_len <= len(first) + len(generated) + len(next_turn)
    sample = asyncio.run(run_episode(setup, ScriptedPolicy([(generated, "stop")] * 4), task_idx=0))
    assert sample.finish_reason == "context" and sample.num_turns == 1
    assert len(sample.tokens) == len(first) + len(generated)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tokenizer = build_char_tokenizer()
    # Renders the conversation newest message first: nothing appends.
    tokenizer.chat_template = ("{% for message in messages | reverse %}{{ message['role'][0] + ': ' + "
                               "message['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}a: {% endif %}")
    with pytest.raises(ValueError, match="chat template of tokenizer 'Qwen2Tokenizer'.*actor.chat_template"):
        make_format(tokenizer, "auto")
    assert isinstance(make_format(tokenizer, "none"), PlainFormat)


def test_stop_strings_are_found_where_they_end_among_new_tokens_only():
    from actors.engine import check_stops, find_stop

    tok = build_char_tokenizer()
    stops = check_stops(["END", "ab"])
    seq = tok.encode("xxENDyyab", add_special_tokens=False)
    assert find_stop(tok.decode, seq, stops, 0) == 5  # the first match's end
    assert find_stop(tok.decode, seq, stops, 5) == 9  # "END" was checked before: the next one
    assert find_stop(tok.decode, seq, stops, 4) == 5  # "END" begun in tokens before, ended in a new one
    assert find_stop(tok.decode, seq, stops, 9) is None
    long = tok.encode("x" * 100 + "yyENDab", add_special_tokens=False)  # only a window before new tokens is decoded
    assert find_stop(tok.decode, long, stops, 103) == 105 and find_stop(tok.decode, long, stops, 105) == 107
    with pytest.raises(ValueError, match="actor.stop entry '' is empty"):
        check_stops([""])


def test_a_stop_string_inside_a_bpe_token_ends_the_turn():
    """Issue 26: stops were matched on the token ids of the string encoded alone, so with a BPE
    tokenizer that merges ".\\n" (as Qwen2.5's does) the default stop "\\n" never ended a turn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from actors.engine import find_stop

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    words = ["north", "south", "east", "west", "wall", "door", "key", "box", "up", "down"]
    bpe.train_from_iterator([f"{w}.\n" for w in words] * 20, trainers.BpeTrainer(  # the most frequent pair: ".\\n"
        vocab_size=len(alphabet) + 1, initial_alphabet=alphabet, show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    ids = tok.encode("go north.\nObservation", add_special_tokens=False)
    newline = tok.encode("\n", add_special_tokens=False)
    assert not any(ids[i:i + len(newline)] == newline for i in range(len(ids)))  # "\\n" only inside a token
    end = find_stop(tok.decode, ids, ["\n"], 0)
    assert end is not None and tok.decode(ids[:end]).endswith("\n") and tok.decode(ids[:end - 1]) == "go north"


def test_turns_carry_the_state_they_acted_in(tiny_tokenizer):
    """grid_nav reports its cell as info["state"]; a turn whose action does not parse leaves the
    state as it was, so the next turn acts in the same one; reset reports none (the observation)."""
    import hashlib

    from actors.episode import state_key

    cfg = ActorConfig(max_turns=4, max_tokens=4, max_seq_len=1000, action_template="tag")
    client = LocalEnvClient("grid_nav")
    setup = EpisodeSetup(client, tiny_tokenizer, cfg, make_template("tag"), "grid_nav")
    moves = ["<action>n</action>", "nothing", "<action>e</action>", "<action>s</action>"]
    policy = ScriptedPolicy([(tiny_tokenizer.encode(m, add_special_tokens=False), "stop") for m in moves])
    sample = asyncio.run(run_episode(setup, policy, task_idx=3))
    key = lambda text: hashlib.blake2b(text.encode(), digest_size=8).hexdigest()  # noqa: E731
    replay = make_env("grid_nav")
    first = replay.reset(3)
    cells = [replay.step(m).info["state"] for m in ("n", "e", "s")]
    want = [key(first), key(cells[0]), key(cells[0]), key(cells[1])][:sample.num_turns]
    assert sample.num_turns >= 3 and sample.turn_states == want and sample.invalid_actions == 1
    assert state_key(StepResult("obs", 0.0, False, {"state": "2,3"})) == key("2,3")


def test_the_turns_the_env_refused_are_recorded(tiny_tokenizer):
    """TextCraft refuses `get 1 dirt block` ("Could not find dirt block"): the sample names that
    turn, and every turn stays generated (what the loss does with it is the learner's choice,
    learner.refused_turns). An env without a pattern records none."""
    cfg = ActorConfig(max_turns=3, max_tokens=40, max_seq_len=2000)
    actions = ["inventory\n", "get 1 dirt block\n", "get 1 acacia logs\n"]
    turn_ids = [tiny_tokenizer.encode(a, add_special_tokens=False) for a in actions]
    setup = EpisodeSetup(LocalEnvClient("textcraft"), tiny_tokenizer, cfg, make_template("raw"), "textcraft")
    transcript: list[dict] = []
    sample = asyncio.run(run_episode(setup, ScriptedPolicy([(ids, "stop") for ids in turn_ids]), task_idx=0,
                                     transcript=transcript))
    assert [t["value"] for t in transcript if t["from"] == "human"][2].startswith("Could not find dirt block")
    assert sample.num_turns == 3 and sample.refused_turns == [1]
    assert [ids for generated, ids in runs(sample) if generated] == turn_ids
    letters = EpisodeSetup(LocalEnvClient("letters"), tiny_tokenizer, cfg, make_template("raw"), "letters")
    other = asyncio.run(run_episode(letters, ScriptedPolicy([(ids, "stop") for ids in turn_ids]), task_idx=0))
    assert other.num_turns >= 1 and other.refused_turns == []


def test_a_char_tokenizer_filled_to_a_real_vocabulary_encodes_as_before_and_decodes_every_id(tmp_path):
    """`omrl init-model --vocab 151936`: a model of Qwen2.5's vocabulary size whose tokenizer has a
    token for every id a random model samples (vLLM decodes what it samples)."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    small, full = build_char_tokenizer(), build_char_tokenizer(151_936)
    assert len(full) == 151_936
    text = "Thought: go to the red ball 42.\nAction: go"
    assert full.encode(text) == small.encode(text) and full.decode(full.encode(text)) == text
    assert all(full.decode([i]) for i in range(0, 151_936, 997))
    assert full.decode([151_934]) == "".join(full.convert_ids_to_tokens([151_934]))  # a filler: its letters
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "init-model", str(tmp_path / "m"), "--hidden", "32",
                           "--layers", "1", "--heads", "4", "--kv-heads", "2", "--vocab", "5000", "--tie-embeddings"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["vocab_size"], config["num_key_value_heads"], config["num_attention_heads"]) == (5000, 2, 4)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "m")) == 5000


def qwen3_tokenizer():
    """The char tokenizer with Qwen3's special and added tokens and its published chat template
    (tests/data/qwen3_chat_template.jinja), which renders the newest assistant turn with a
    <think> block and earlier ones without."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = (Path(__file__).parents[1] / "data" / "qwen3_chat_template.jinja").read_text()
    return tokenizer


def test_qwen3s_template_appends_token_exactly_and_keeps_the_models_reasoning():
    tokenizer = qwen3_tokenizer()
    render = lambda messages, **kw: tokenizer.apply_chat_template(messages, tokenize=True,  # noqa: E731
                                                                  return_dict=False, **kw)
    # Its renders are not prefixes of each other at the newest assistant turn (refused before issue 26).
    u, a = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}
    assert render([u, a])[:len(render([u, a, u]))] != render([u, a, u])[:len(render([u, a]))]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns, max_turns = 3, 2
    texts = [f"<action>{x}</action>" for x in letters_of(0, turns)]
    plain = [tokenizer.encode(t, add_special_tokens=False) + [im_end] for t in texts]
    sample, _, setup = episode(tokenizer, [(ids, "stop") for ids in plain], turns, max_turns)
    assert isinstance(setup.format, ChatFormat) and setup.format.assistant_suffix == tokenizer.encode(
        "<|im_end|>\n", add_special_tokens=False)
    # Turns as the template writes them: the episode is the render of its conversation.
    env = make_env("letters", turns=turns)
    observations = [env.reset(0)] + [env.step(x).observation for x in letters_of(0, turns)]
    messages = [{"role": "system", "content": SYSTEM}]
    for obs, text in zip(observations, texts[:max_turns]):
        messages += [{"role": "user", "content": obs}, {"role": "assistant", "content": text}]
    messages.append({"role": "user", "content": observations[max_turns]})
    assert sample.tokens.tolist() == render(messages, add_generation_prompt=True)

    # Turns as Qwen3 samples them in thinking mode: each generation, its <think> block included,
    # stays in the buffer as sampled (a re-render would drop earlier turns' reasoning); the
    # context between turns is the same as above.
    thought = [tokenizer.encode(f"<think>\nI go {x}.\n</think>\n\n", add_special_tokens=False) + ids
               for x, ids in zip("ab", plain)]
    thinking, _, _ = episode(tokenizer, [(ids, "stop") for ids in thought], turns, max_turns)
    assert [ids for is_gen, ids in runs(thinking) if is_gen] == thought[:max_turns]
    assert [ids for is_gen, ids in runs(thinking) if not is_gen] == [ids for is_gen, ids in runs(sample) if not is_gen]
    # The newest turn is exactly the template's own render of an assistant message with that reasoning.
    last = render(messages[:-1][:-1] + [{"role": "assistant", "content": texts[1], "reasoning_content": "I go b."}])
    first = render(messages[:-1][:-1], add_generation_prompt=True)
    assert last[len(first):] == thought[1] + tokenizer.encode("\n", add_special_tokens=False)


def test_the_fast_encoder_encodes_as_the_tokenizer_does_or_is_not_used(tiny_tokenizer):
    from actors.chat import text_encoder

    texts = ["", "Say a", "<|im_start|>user\nSay b<|im_end|>\n", "  two  spaces\n\n\tand tabs", "été 你好 ✓", "x" * 300]
    for tokenizer in (tiny_tokenizer, chatml_tokenizer()):
        encode = text_encoder(tokenizer)
        assert encode is not None and [encode(t) for t in texts] == [
            list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    class Odd:  # a tokenizer whose Rust backend encodes differently: its own path is kept
        _tokenizer = type("Backend", (), {"encode": lambda self, text, add_special_tokens: type("E", (), {"ids": [0]})})()

        def encode(self, text, add_special_tokens):
            return [1, 2]

    assert text_encoder(Odd())("anything") == [1, 2]
