"""Trajectory files and supervised fine-tuning, without servers: the AgentGym conversation import on
a hand-written file, the token masks it gives, the SFT loss on agent tokens only (against a plain
reference, and blind to what is not trained on), micro-batching that changes nothing, and the
word tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from actors.chat import ChatFormat, PlainFormat
from actors.trajectories import (
    TrajectoryError,
    load_conversations,
    read_episodes,
    tokenize,
    with_tokens,
    write_episodes,
)
from common.config import LearnerConfig, SFTConfig
from common.models import (
    TINY_CHAT_TEMPLATE,
    build_char_tokenizer,
    build_word_tokenizer,
    init_tiny_model,
    load_causal_lm,
)
from learner.sft import SFTTrainer

CPU = LearnerConfig(device="cpu")  # where the SFT tests train

# AgentGym's AgentTraj layout: an instruction turn, the agent's "OK" (not trained on: loss false),
# then observations and actions; `item_id` names the env and the task.
AGENTGYM = [
    {"item_id": "babyai_41", "conversations": [
        {"from": "human", "loss": None, "value": "You are an agent. Answer with an action."},
        {"from": "gpt", "loss": False, "value": "OK"},
        {"from": "human", "loss": None, "value": "Your goal: go to the red ball"},
        {"from": "gpt", "loss": True, "value": "go to red ball 1"},
        {"from": "human", "loss": None, "value": "The task is completed."},
        {"from": "gpt", "loss": True, "value": "done"},
    ]},
]
# OpenAI-style messages, as JSON lines.
MESSAGES = {"id": "x", "messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Say a."}, {"role": "assistant", "content": "a"}]}


@pytest.fixture
def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def trained_text(tokenizer, tokens, mask) -> list[str]:
    """The runs of trained tokens, decoded."""
    runs, current = [], []
    for t, m in zip(tokens, mask):
        if m:
            current.append(t)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_agentgym_conversations_import_with_masks_on_trained_agent_turns_only(tmp_path, chat_tokenizer):
    path = tmp_path / "traj.json"
    path.write_text(json.dumps(AGENTGYM))
    [row] = load_conversations(path)
    assert (row["env"], row["task_idx"], row["num_turns"]) == ("babyai", 41, 3)
    [row] = with_tokens(ChatFormat(chat_tokenizer), [row], str(path))
    text = chat_tokenizer.decode(row["tokens"])
    # The tiny template: "U: " before each observation, each agent turn followed by a line break.
    assert text == ("U: You are an agent. Answer with an action.OK\nU: Your goal: go to the red ball"
                    "go to red ball 1\nU: The task is completed.done\n")
    assert trained_text(chat_tokenizer, row["tokens"], row["loss_mask"]) == ["go to red ball 1\n", "done\n"]

    # The parquet round trip keeps everything; reading it back tokenises the same.
    write_episodes(tmp_path / "traj.parquet", [row])
    [back] = read_episodes(tmp_path / "traj.parquet")
    assert back["tokens"] == row["tokens"] and back["loss_mask"] == row["loss_mask"]
    assert tokenize(ChatFormat(chat_tokenizer), back["conversations"]) == (row["tokens"], row["loss_mask"])


def test_openai_messages_as_json_lines_and_a_plain_format(tmp_path):
    path = tmp_path / "msgs.jsonl"
    path.write_text(json.dumps(MESSAGES) + "\n\n" + json.dumps(MESSAGES) + "\n")
    rows = load_conversations(path)
    assert len(rows) == 2 and rows[0]["env"] is None
    tokenizer = build_char_tokenizer()
    tokens, mask = tokenize(PlainFormat(tokenizer, ["\n"]), rows[0]["conversations"])
    assert tokenizer.decode(tokens) == "Be brief.Say a.a\n"  # plain: system, observation, then the answer
    assert trained_text(tokenizer, tokens, mask) == ["a\n"]
    tokens, mask = tokenize(PlainFormat(tokenizer), rows[0]["conversations"])  # no stop string: the EOS ends a turn
    assert tokens[-1] == tokenizer.eos_token_id and mask[-2:] == [1, 1]


@pytest.mark.parametrize("records, message", [
    ([{"conversations": [{"from": "gpt", "value": "hi"}]}], "must start with a human turn"),
    ([{"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}], "turn 1: expected a gpt"),
    ([{"conversations": [{"from": "robot", "value": "a"}]}], "record 0, turn 0"),
    ([{"text": "no turns"}], "no `conversations`"),
])
def test_bad_conversations_are_refused_naming_the_record_and_turn(tmp_path, chat_tokenizer, records, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(records))
    with pytest.raises(TrajectoryError, match=message):
        with_tokens(ChatFormat(chat_tokenizer), load_conversations(path), str(path))


def test_a_file_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{not json\n")
    with pytest.raises(TrajectoryError, match="is not JSON lines"):
        load_conversations(path)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return str(init_tiny_model(tmp_path_factory.mktemp("sft-model")))


def reference_nll(model, examples) -> float:
    """Full logits, log-softmax, the trained positions only: the mean NLL per trained token."""
    total, n = 0.0, 0
    with torch.no_grad():
        for tokens, mask in examples:
            t = torch.tensor([tokens])
            logp = torch.log_softmax(model(input_ids=t).logits.float()[0, :-1], -1)
            picked = logp.gather(1, t[0, 1:, None])[:, 0]
            m = torch.tensor(mask[1:], dtype=torch.bool)
            total -= float(picked[m].sum())
            n += int(m.sum())
    return total / n


def test_sft_loss_is_the_nll_of_agent_tokens_and_blind_to_the_rest(lm):
    model = load_causal_lm(lm)
    trainer = SFTTrainer(model, CPU, SFTConfig(lr=1e-3, max_tokens_per_microbatch=40), total_steps=10)
    a = ([5, 9, 12, 3, 7, 7, 2, 30, 31], [0, 0, 0, 1, 1, 0, 0, 1, 0])
    b = ([8, 1, 4, 4, 20], [0, 0, 1, 1, 1])
    nll = trainer.evaluate([a, b])
    assert nll == pytest.approx(reference_nll(model, [a, b]), rel=1e-5)
    # What is not trained on changes nothing when nothing trained follows it: a's last token.
    changed = (a[0][:-1] + [44], a[1])
    assert trainer.evaluate([changed, b]) == pytest.approx(nll, rel=1e-6)
    # ...and a context token before a trained one does (it is read, not scored).
    assert trainer.evaluate([([5, 9, 40] + a[0][3:], a[1]), b]) != pytest.approx(nll, rel=1e-6)
    with pytest.raises(ValueError, match="no trained token"):
        trainer.step([(a[0], [0] * len(a[0]))])


def test_micro_batching_gives_the_step_of_one_forward(lm):
    examples = [([3 + i % 40 for i in range(n)], [int(i % 3 == 0) for i in range(n)]) for n in (7, 12, 30, 5, 18)]
    steps = {}
    for max_tokens in (16, 100_000):
        torch.manual_seed(0)
        model = load_causal_lm(lm)
        trainer = SFTTrainer(model, CPU, SFTConfig(lr=1e-2, max_tokens_per_microbatch=max_tokens), total_steps=1)
        # Plain SGD, so the weights show the gradient (Adam's first step is about lr x its sign).
        trainer.optimizer = torch.optim.SGD(trainer.scorer.parameters(), lr=1.0)
        metrics = trainer.step(examples)
        steps[max_tokens] = (metrics["sft/loss"], metrics["sft/grad_norm"], trainer.state_dict())
    (l1, g1, s1), (l2, g2, s2) = steps.values()
    assert l1 == pytest.approx(l2, rel=1e-5) and g1 == pytest.approx(g2, rel=1e-4)
    assert all(torch.allclose(s1[k], s2[k], atol=1e-6) for k in s1)


def sft_gradients(lm, examples, **learner) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and the gradients of one SFT step, with the learner settings `learner`."""
    torch.manual_seed(0)
    trainer = SFTTrainer(load_causal_lm(lm), LearnerConfig(device="cpu", **learner),
                         SFTConfig(max_tokens_per_microbatch=40), total_steps=1)
    assert trainer.scorer.lm.is_gradient_checkpointing == learner.get("gradient_checkpointing", False)
    grads = {}
    trainer.optimizer.step = lambda: grads.update({n: p.grad.clone() for n, p in trainer.scorer.named_parameters()})
    return trainer.step(examples)["sft/loss"], grads


def test_sft_trains_as_the_learner_does_bf16_and_gradient_checkpointing(lm):
    """SFT computes as learner.precision and learner.gradient_checkpointing say, through the RL
    trainer's own placement and autocast."""
    examples = [([3 + i % 40 for i in range(n)], [int(i % 3 == 0) for i in range(n)]) for n in (7, 12, 30, 5, 18)]
    loss, grads = sft_gradients(lm, examples)
    recomputed_loss, recomputed = sft_gradients(lm, examples, gradient_checkpointing=True)
    assert recomputed_loss == pytest.approx(loss, rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(recomputed[name], g, rtol=1e-4, atol=1e-6, msg=name)
    bf16_loss, bf16 = sft_gradients(lm, examples, precision="bf16")
    assert bf16_loss == pytest.approx(loss, rel=2e-2) and bf16_loss != loss  # bf16 rounding shows, and stays small
    for name, g in grads.items():
        assert float((bf16[name] - g).norm()) <= 5e-2 * float(g.norm()) + 5e-4, name


def test_the_word_tokenizer_makes_each_word_one_token_and_decodes_exactly(tmp_path):
    texts = ["Your goal: go to the red ball\nThere is a red ball 1 2 steps in front of you.", "turn left",
             "go to red ball 1"]
    tokenizer = build_word_tokenizer(texts)
    for word in ("Your", " goal", " ball", " front", "turn", " left"):
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1, word
    unseen = "A zebra! \u00e9"
    for text in texts + [unseen]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode(texts[0], add_special_tokens=False)) < len(texts[0]) / 3
    # Saved with a tiny model, it loads back as any tokenizer does, chat template included.
    from transformers import AutoTokenizer

    out = init_tiny_model(tmp_path / "m", tokenizer=tokenizer)
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.encode(texts[0], add_special_tokens=False) == tokenizer.encode(texts[0], add_special_tokens=False)
    assert ChatFormat(loaded).assistant_suffix == loaded.encode("\n", add_special_tokens=False)
