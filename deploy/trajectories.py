"""`omrl collect` and `omrl import-trajectories`: trajectory files for `omrl sft`.

collect: an env's oracle (or random policy) plays tasks of the train split (or the test
split, `--split test`) through the actors' episode loop, with the configured action template
and the model's tokenizer and chat template; the file holds the conversations and the tokens
and loss masks the actors would have built. With `--noise`, a share of the oracle's turns are
mistakes outside the loss: the env's, or with `--mistakes model` the model's own sampled turns,
so that the oracle's turns label the states the model reaches (DAgger's data).
import-trajectories: AgentGym / OpenManus-RL conversation files (JSON, JSON lines) to the
same parquet rows, tokenised for `--model`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from typing import Any

from common.cli import config_from_args
from common.config import Config

log = logging.getLogger("omrl.collect")


def collect_main(args: argparse.Namespace) -> int:
    from actors.evaluate import check_noise
    from actors.trajectories import write_episodes

    if args.episodes < 1:
        raise SystemExit("error: --episodes must be at least 1")
    try:  # here, before an engine starts
        check_noise(args.noise)
    except ValueError as exc:
        raise SystemExit(f"error: --{exc}") from None
    if args.mistakes == "model" and not (args.model and args.noise > 0 and args.policy == "oracle"):
        raise SystemExit("error: --mistakes model needs --policy oracle, --model (the model that plays them) and "
                         "--noise above 0 (the share of the oracle's turns it plays)")
    cfg = _config(args, {"env.name": args.env, "env.tasks": args.tasks or None})
    from envs.base import EpisodeError

    started = time.monotonic()
    try:
        rows = asyncio.run(_collect(cfg, args))
    except (EpisodeError, ValueError) as exc:  # an env without that policy, a bad task file
        raise SystemExit(f"error: {exc}") from None
    played = len(rows)
    if args.only_success:
        rows = [r for r in rows if r["success"]]
    path = write_episodes(args.out, rows)
    wins = sum(r["success"] for r in rows)
    log.info("%d episodes in %.0f s; %d written (%d solved), %.0f tokens each on average", played,
             time.monotonic() - started, len(rows), wins, sum(len(r["tokens"]) for r in rows) / max(1, len(rows)))
    print(path)
    return 0


async def _collect(cfg: Config, args: argparse.Namespace) -> list[dict]:
    import aiohttp

    from actors.episode import EpisodeSetup
    from actors.evaluate import PinnedModelPolicy, ServerPolicy
    from actors.templates import make_template
    from actors.trajectories import collect
    from common.progress import Progress
    from deploy.evaluate import env_server, model_engine, tokenizer_of
    from envs.client import EnvClient
    from envs.specs import spec_of
    from envs.tasks import task_data, task_split

    train, test = task_split(cfg.env)
    tasks = list(train if args.split == "train" else test)[:args.episodes]
    if len(tasks) < args.episodes:
        log.warning("the %s split has %d tasks: playing each once", args.split, len(tasks))
    engine = model_engine(cfg) if args.mistakes == "model" else None
    mistakes = PinnedModelPolicy(engine, version=0, temperature=args.temperature) if engine else None
    who = f"{args.policy}, {args.noise:.0%} of its turns the model's" if engine else args.policy
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
            async with env_server(cfg.env.name, cfg, None) as url:
                client = EnvClient(url, session, cfg.env.timeout_s, spec_of(cfg.env))
                setup = EpisodeSetup(client, engine.tokenizer if engine else tokenizer_of(cfg), cfg.actor,
                                     make_template(cfg.actor.action_template), cfg.env.name, task_data(cfg.env))
                policy = ServerPolicy(setup, args.policy, args.noise, args.seed, mistakes)
                with Progress(len(tasks), "episodes", f"collecting {cfg.env.name} ({who})") as bar:
                    return await collect(setup, policy, args.policy, tasks, progress=lambda _done: bar.update())
    finally:
        if engine is not None:
            engine.shutdown()


def import_main(args: argparse.Namespace) -> int:
    from actors.chat import make_format
    from actors.trajectories import TrajectoryError, load_conversations, with_tokens, write_episodes
    from deploy.evaluate import tokenizer_of

    cfg = _config(args, {})
    fmt = make_format(tokenizer_of(cfg), cfg.actor.chat_template, cfg.actor.stop)
    try:
        rows = with_tokens(fmt, load_conversations(args.source), args.source)
    except (TrajectoryError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    path = write_episodes(args.out, rows)
    log.info("%d conversations, %d agent turns, %d trained tokens", len(rows), sum(r["num_turns"] for r in rows),
             sum(sum(r["loss_mask"]) for r in rows))
    print(path)
    return 0


def _config(args: argparse.Namespace, flags: dict[str, Any]) -> Config:
    from common.logs import setup_logging

    setup_logging("collect", "INFO", sys.stderr)  # stdout is the output path
    return config_from_args(args, {**flags, "model.path": args.model or None})
