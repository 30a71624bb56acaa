"""`omrl eval`: a model (or the oracle, or the random policy) plays the test split of one or
more envs; one table row per env (success rate and mean reward with 95% CIs), and JSON.

Each env is served by our env server in this process, unless --env-url names a server
someone else started (an AgentGym one, say).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
from pathlib import Path

from common.cli import add_config_args, config_from_args, stop_on_sigterm
from common.config import Config, EnvSpecConfig

log = logging.getLogger("omrl.eval")


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--env", action="append", required=True, help="env name (repeatable: one table row each)")
    p.add_argument("--model", help="model path or hub id (model.path); needed for --policy model")
    p.add_argument("--policy", choices=("model", "oracle", "random"), default="model",
                   help="model: the model; oracle and random: our env server's own (the ceiling and the floor)")
    p.add_argument("--env-url", help="an env server someone else started (one --env only)")
    p.add_argument("--tasks", help="task files directory (env.tasks); default: the env's held-out tasks")
    p.add_argument("--episodes", type=int, default=100, help="test tasks to play, from the start of the split")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out", help="also write the JSON here")


def main(args: argparse.Namespace) -> int:
    from common.logs import setup_logging

    setup_logging("eval", "INFO", sys.stderr)  # stdout is the table or the JSON
    stop_on_sigterm()
    cfg = config_from_args(args, {"model.path": args.model or None})
    if args.env_url and len(args.env) > 1:
        raise SystemExit("error: --env-url names one server: give one --env with it")
    if args.policy == "model" and not cfg.model.path:
        raise SystemExit("error: --policy model needs --model PATH (or model.path)")
    if args.episodes < 1:
        raise SystemExit("error: --episodes must be at least 1")
    from envs.base import EpisodeError

    try:
        results = asyncio.run(_evaluate_all(cfg, args))
    except EpisodeError as exc:  # an env server that fails, a reward function that fails: one line
        raise SystemExit(f"error: {exc}") from None
    rows = [dataclasses.asdict(r) for r in results]
    text = json.dumps(rows, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text, flush=True)
    else:
        from actors.evaluate import TABLE_HEADER

        print(TABLE_HEADER)
        for r in results:
            print(r.row(), flush=True)
    return 0


async def _evaluate_all(cfg: Config, args: argparse.Namespace):
    import aiohttp

    from actors.agents import load_agent, serve_agents
    from actors.episode import EpisodeSetup
    from actors.evaluate import PinnedModelPolicy, ServerPolicy, evaluate
    from actors.templates import make_template
    from common.progress import Progress
    from envs.client import EnvClient
    from envs.specs import spec_of
    from envs.tasks import task_data, task_split

    try:  # your agent (actor.agent, agent_url) plays the model's episodes, as the evaluator of a run has it
        agent = load_agent(cfg.actor) if args.policy == "model" else None
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    engine = model_engine(cfg) if args.policy == "model" else None
    tokenizer = engine.tokenizer if engine else tokenizer_of(cfg)
    results = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
            for name in args.env:
                env_cfg = cfg.env.model_copy(update={"name": name, "tasks": args.tasks or cfg.env.tasks,
                                                     "spec": cfg.env.spec if name == cfg.env.name else EnvSpecConfig()})
                _train, test = task_split(env_cfg)
                tasks = list(test)[:args.episodes]
                async with env_server(name, cfg, args.env_url) as url:
                    client = EnvClient(url, session, cfg.env.timeout_s, spec_of(env_cfg), cfg.env.reuse_instances)
                    setup = EpisodeSetup(client, tokenizer, cfg.actor, make_template(cfg.actor.action_template), name,
                                         task_data(env_cfg))
                    policy = (PinnedModelPolicy(engine, version=0, temperature=args.temperature) if engine
                              else ServerPolicy(setup, args.policy))
                    gateway, play = None, None
                    if agent is not None:
                        served = cfg.model_copy(update={"env": env_cfg.model_copy(update={"url": url})})
                        gateway, rollouts = await serve_agents(served, engine, policy, agent, setup.task_data,
                                                               evaluator=True)
                        play = lambda task, rollouts=rollouts: rollouts.run(task, 0)  # noqa: E731
                    log.info("evaluating %s on %d held-out tasks of %s%s", args.policy, len(tasks), name,
                             f" (the agent {cfg.actor.agent_name})" if agent else "")
                    try:
                        with Progress(len(tasks), "episodes", f"{args.policy} on {name}") as bar:
                            results.append(await evaluate(setup, policy, tasks, args.policy, progress=bar.update,
                                                          play=play))
                    finally:
                        if gateway is not None:
                            await gateway.cleanup()
                    await client.close_kept()
    finally:
        if engine is not None:
            engine.shutdown()
    return results


@contextlib.asynccontextmanager
async def env_server(name: str, cfg: Config, url: str | None):
    if url:
        yield url
        return
    from broker.embedded import free_port
    from envs.server import EnvServer, serve

    port = free_port()
    options = cfg.env.options if name == cfg.env.name else {}
    runner = await serve(EnvServer(name, options), "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


class ModelPlayer:
    """A vLLM engine on cfg.model.path and our env server for one env, in this process: the model
    plays lists of tasks greedily (`play`), on the weights it was started with or on weights
    loaded in place (`load`), as an actor's engine takes a new version."""

    def __init__(self, cfg: Config, env_name: str):
        self.cfg, self.env_name = cfg, env_name

    async def __aenter__(self) -> ModelPlayer:
        import aiohttp

        from actors.episode import EpisodeSetup
        from actors.templates import make_template
        from envs.client import EnvClient
        from envs.specs import spec_of
        from envs.tasks import task_data

        cfg = self.cfg
        self._stack = contextlib.AsyncExitStack()
        try:  # what started is stopped if the rest fails: __aexit__ does not run then
            self.engine = model_engine(cfg)
            self._stack.callback(self.engine.shutdown)
            session = await self._stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)))
            url = await self._stack.enter_async_context(env_server(self.env_name, cfg, None))
            client = EnvClient(url, session, cfg.env.timeout_s, spec_of(cfg.env, self.env_name))
            self.setup = EpisodeSetup(client, self.engine.tokenizer, cfg.actor,
                                      make_template(cfg.actor.action_template), self.env_name,
                                      task_data(cfg.env) if self.env_name == cfg.env.name else {})
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stack.__aexit__(*exc)

    async def load(self, state: dict) -> None:
        """Weights named as in Hugging Face (a state dict of the causal LM), loaded in place."""
        import tempfile

        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/weights.safetensors"
            save_file({k: v.contiguous() for k, v in state.items()}, path)
            await self.engine.load_weights(path)

    async def play(self, tasks: list[int], version: int = 0, temperature: float = 0.0, samples: int = 1):
        from actors.evaluate import PinnedModelPolicy, evaluate

        result = await evaluate(self.setup, PinnedModelPolicy(self.engine, version, temperature), tasks, "model",
                                samples=samples)
        log.info("%s, %d held-out tasks: success %.3f [%.3f, %.3f]", self.env_name, result.episodes, result.success,
                 *result.success_ci)
        return result


def eval_row(result) -> dict:
    """An EvalResult as metrics (the keys the learner's evaluations use)."""
    return {"eval/success": result.success, "eval/success_ci": list(result.success_ci), "eval/reward": result.reward,
            "eval/reward_ci": list(result.reward_ci), "eval/episodes": result.episodes}


def model_engine(cfg: Config):
    """A vLLM engine on cfg.model.path in this process (its weights as version 0)."""
    from actors.engine import VLLMEngine

    return VLLMEngine(cfg.model, cfg.actor, cfg.model.path, seed=cfg.actor.seed)


def tokenizer_of(cfg: Config):
    """For the oracle and random policies: the model's tokenizer, or the tiny one."""
    if cfg.model.path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(cfg.model.path)
    from common.models import build_char_tokenizer

    return build_char_tokenizer()
