"""Model and tokenizer loading, and the tiny model that `omrl init-model` builds.

The real loading path is `from_pretrained` on a local path or a hub id; the tiny model is
built here and saved with `save_pretrained` so that nothing is ever downloaded.
"""

from __future__ import annotations

import json
import math
import os
import string
from collections.abc import Iterable
from pathlib import Path

TINY_EOS = "<|endoftext|>"
TINY_CHARS = "\n" + string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,:;!?'\"-+*/=()<>[]_#"
# The tiny model's chat template, over characters of TINY_CHARS (no special tokens to add):
# "S: " and the system text and a line break, "U: " and the observation, then the answer and a
# line break. There is no generation prompt, so a prompt ends with the observation (the
# letters env's letter, which a random 2-layer model learns to repeat quickly). The actors stop
# at "\n" (actor.stop), which is the whole end of an assistant turn.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] + '\\n' }}"
    "{% elif message['role'] == 'system' %}{{ 'S: ' + message['content'] + '\\n' }}"
    "{% else %}{{ 'U: ' + message['content'] }}{% endif %}"
    "{% endfor %}"
)
# The same with each turn marked, as real chat templates mark them: "U: " and the observation and
# a line break, "A: " and the answer and a line break; the generation prompt is "A: ". Where an
# observation repeats the action it refuses (TextCraft's "Could not execute get"), a model of
# the unmarked template reads the refused text as the start of its own next action and goes on
# writing it (docs/results/textcraft-demo.md, section 12).
TURNS_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ 'A: ' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'system' %}{{ 'S: ' + message['content'] + '\\n' }}"
    "{% else %}{{ 'U: ' + message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
)
CHAT_TEMPLATES = {"plain": TINY_CHAT_TEMPLATE, "turns": TURNS_CHAT_TEMPLATE}


def build_char_tokenizer(size: int | None = None):
    """A character-level tokenizer of the Qwen2 kind: a byte-level BPE whose vocabulary is
    one symbol per character of TINY_CHARS and which has no merges, so every character is
    one token. Being a real Qwen2Tokenizer, it loads the same way in transformers and vLLM.

    `size`: the vocabulary filled up to `size` tokens (the end-of-text one included) with
    tokens of two and three letters or digits, which encoding never produces (no merges) and
    decoding reads as their text: a model of a real vocabulary's size (151,936 in Qwen2.5)
    has a token for every id it can sample."""
    import itertools

    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_symbol = bytes_to_unicode()
    vocab = {byte_to_symbol[ord(ch)]: i for i, ch in enumerate(TINY_CHARS)}
    if size is not None:
        symbols = string.ascii_letters + string.digits  # their byte-level symbols are themselves
        fillers = itertools.chain(itertools.product(symbols, repeat=2), itertools.product(symbols, repeat=3))
        for token in ("".join(t) for t in fillers):
            if len(vocab) >= size - 1:
                break
            vocab.setdefault(token, len(vocab))
        if len(vocab) != size - 1:
            raise ValueError(f"a character tokenizer holds {len(TINY_CHARS) + 1} to {len(vocab) + 1} tokens, not {size}")
    return Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token=TINY_EOS, pad_token=TINY_EOS)

def build_word_tokenizer(texts: Iterable[str], max_words: int = 4096):
    """A word-level tokenizer for the text an env speaks: a byte-level BPE of the Qwen2 kind
    whose merges are learned from `texts` until every word they contain is one token (a word
    with its leading space: " ball"). Text it has not seen still encodes, byte by byte, and
    every token decodes to exactly its text, so actions parse and episodes re-tokenise as with
    any Qwen2 tokenizer; a BabyAI episode is a few hundred tokens instead of thousands of
    characters. Like the character one it loads the same way in transformers and vLLM."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    pre_tokenizer = build_char_tokenizer().backend_tokenizer.pre_tokenizer  # Qwen2's word split
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + max_words, min_frequency=1, initial_alphabet=alphabet,
                                  show_progress=False, special_tokens=[])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizer
    bpe.train_from_iterator(texts, trainer)
    trained = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    return Qwen2Tokenizer(vocab=trained["vocab"], merges=merges, unk_token=None, eos_token=TINY_EOS,
                          pad_token=TINY_EOS)


TINY_MAX_POSITIONS = 4096  # the tiny model's context


def init_tiny_model(out_dir: str | Path, hidden: int = 128, layers: int = 2, heads: int = 2, seed: int = 0,
                    tie_embeddings: bool = False, tokenizer=None, intermediate: int | None = None,
                    kv_heads: int | None = None, template: str = "plain") -> Path:
    """Build a small Qwen2-architecture causal LM with random weights and `tokenizer` (default:
    the character one) with the chat template CHAT_TEMPLATES[template] (plain: TINY_CHAT_TEMPLATE),
    and save both to `out_dir` with `save_pretrained`. The model's vocabulary is the tokenizer's;
    `kv_heads` key-value heads (default: `heads`)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATES[template]
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        max_position_embeddings=TINY_MAX_POSITIONS, tie_word_embeddings=tie_embeddings, rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def load_causal_lm(path_or_id: str, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path_or_id, dtype=getattr(torch, dtype))


def save_policy(model, tokenizer_from: str, out: str | Path, state_dict: dict | None = None,
                files: dict[str, str] | None = None, keep_others: bool = False) -> Path:
    """`model` (with `state_dict`'s weights when given) and the tokenizer of `tokenizer_from`,
    written with save_pretrained (what transformers and vLLM load), with `files` (name -> text)
    beside them. Whole or not at all (common/files.py): a process that dies while writing leaves
    the earlier `out` (or none), never a half-written model that a reader loads. `keep_others`:
    what `out` already holds that the model does not write (`omrl sft`'s metrics and plots
    there) is copied into the new directory before it replaces the old one."""
    import shutil

    from transformers import AutoTokenizer

    from common.files import replace_dir, temporary_beside

    out = Path(out).absolute()
    tmp = temporary_beside(out)
    try:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(tmp)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        for entry in out.iterdir() if keep_others and out.is_dir() else ():
            if not (tmp / entry.name).exists():
                (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, tmp / entry.name)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
                      "int32": "I32", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_safetensors(path: str | Path, layout: list[tuple[str, tuple[int, ...], object]], tensors: Iterable) -> int:
    """A safetensors file at `path` (fsync'd; no rename) from `tensors`, (name, tensor) pairs that
    may come one at a time (a generator) in `layout`'s order: (name, shape, torch dtype). The
    header comes from the layout, so each tensor is written as it comes and freed before the
    next: what writing holds is one tensor, never the file's bytes. The file's size."""
    import struct

    import torch

    header, offset = {}, 0
    for name, shape, dtype in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for (name, shape, dtype), (got, tensor) in zip(layout, tensors, strict=True):
            if got != name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"{path}: expected {name} {tuple(shape)} {dtype}, got {got} "
                                 f"{tuple(tensor.shape)} {tensor.dtype}")
            f.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)
            del tensor
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


def is_model_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()
