"""`omrl init-model DIR`: a tiny Qwen2 model with random weights and its tokenizer."""

from __future__ import annotations

import argparse
import sys

from common.models import CHAT_TEMPLATES


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, help="the MLP's width (default: 2 x hidden)")
    p.add_argument("--kv-heads", type=int, help="key-value heads (default: --heads)")
    p.add_argument("--vocab", type=int, help="the char tokenizer filled up to this many tokens, and the model's "
                                             "vocabulary with it (151936: Qwen2.5's)")
    p.add_argument("--tie-embeddings", action="store_true", help="one matrix for the input embedding and output layer")
    p.add_argument("--tokenizer", choices=("char", "word"), default="char",
                   help="char: one token per character; word: one token per word of --env's text")
    p.add_argument("--env", help="the env whose text the word tokenizer learns (played by its oracle and random policy)")
    p.add_argument("--tasks", help="task files directory: the word tokenizer reads episodes of its train split")
    p.add_argument("--env-episodes", type=int, default=400, help="episodes of --env's text to learn the words from")
    p.add_argument("--template", choices=tuple(CHAT_TEMPLATES), default="plain",
                   help="the chat template: plain: \"U: \" and the observation, then the answer and a line break; "
                        "turns: each turn marked and on its own line, \"U: \" the observation, \"A: \" the answer, "
                        "the generation prompt \"A: \"")


def main(args: argparse.Namespace) -> int:
    from common.config import EnvConfig
    from common.models import build_word_tokenizer, init_tiny_model

    tokenizer = None
    if args.vocab is not None:
        if args.tokenizer != "char":
            print("error: --vocab fills the char tokenizer: leave --tokenizer at char", file=sys.stderr)
            return 2
        from common.models import build_char_tokenizer

        tokenizer = build_char_tokenizer(args.vocab)
    if args.tokenizer == "word":
        if not args.env:
            print("error: --tokenizer word learns its words from an env's text: pass --env NAME", file=sys.stderr)
            return 2
        from envs.corpus import env_texts
        from envs.tasks import task_split

        train, _test = task_split(EnvConfig(name=args.env, tasks=args.tasks))
        tokenizer = build_word_tokenizer(env_texts(args.env, train, episodes=args.env_episodes))
    print(init_tiny_model(args.dir, hidden=args.hidden, layers=args.layers, heads=args.heads,
                          tie_embeddings=args.tie_embeddings, tokenizer=tokenizer, intermediate=args.intermediate,
                          kv_heads=args.kv_heads, template=args.template))
    return 0
