"""The evaluator role (`omrl actor --evaluator`; `omrl run` starts one unless learner.eval_every
is 0): an engine of its own, no admission tickets, no groups. It follows the published weight
versions and, at every learner.eval_every-th version it reaches, plays the first
learner.eval_tasks held-out tasks greedily on that one version and publishes the result tagged
with it (broker/evals.py); the learner adds the newest results to its step records and
`omrl status` shows the last one. It loads a version only when one is due, never during an
evaluation, and evaluates the newest due version next, skipping those it was too busy for: the
actors and the learner never wait for it, and a dead evaluator costs evaluations, never the run.
Several evaluators (compose's --scale) share the work: each slot of learner.eval_every versions
goes to the first that claims it in Redis, so a slot another is busy with is not played twice."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import time

import aiohttp

from actors.agents import load_agent, serve_agents
from actors.engine import Engine, VLLMEngine
from actors.episode import EpisodeSetup
from actors.evaluate import PinnedModelPolicy, evaluate
from actors.templates import make_template
from actors.weights import BroadcastLink, apply_newest, first_of, update_gate
from broker.connection import connect
from broker.evals import claim_eval, finish_eval
from broker.keys import Keys
from broker.membership import Membership
from broker.retry import REDIS_TRANSIENT, RetryPolicy
from broker.weights import Announcements, WeightStore
from common.config import Config, require_set
from common.gpus import evaluator_devices, visible_gpus
from common.liveness import beating
from common.logs import first_line
from common.retry import wait_set
from envs.base import EpisodeError
from envs.client import EnvClient
from envs.specs import spec_of
from envs.tasks import task_data, task_split

log = logging.getLogger(__name__)


class Evaluator:
    """`engine` replaces the vLLM engine that `run` builds (tests pass a scripted one)."""

    def __init__(self, cfg: Config, engine: Engine | None = None):
        require_set(cfg, "model.path", "redis.url")
        self.cfg, self.engine = cfg, engine
        try:
            self.template = make_template(cfg.actor.action_template)
            _train, test = task_split(cfg.env)
            self.tasks = list(test)[:cfg.learner.eval_tasks]
            self.task_data = task_data(cfg.env)
            # With your own agent (actor.agent, agent_url) it plays the held-out tasks through an endpoint of
            # this engine's, greedily on the version being evaluated; else the episode loop does.
            self.agent = load_agent(cfg.actor)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
        self.name = f"{socket.gethostname()}-evaluator"  # one a host or container, as a replica of a service
        self.incarnation = f"{os.getpid()}.{time.time_ns() // 1_000_000}"
        self.stop = asyncio.Event()
        self.evaluations = 0
        self.last: dict | None = None  # the newest result published
        self.rollouts = None

    async def run(self) -> None:
        cfg = self.cfg
        keys = Keys(cfg.redis.run, cfg.redis.shards)
        client = connect(cfg.redis)
        retry = RetryPolicy(attempts=cfg.redis.retry_attempts)
        if self.engine is None:
            if not place_on_gpus(cfg):
                log.error("no GPU left for the evaluator: learner.ranks = %d and actor.num_actors = %d take every "
                          "visible one; it stays down (one more GPU, fewer actors, or learner.eval_every = 0)",
                          cfg.learner.ranks, cfg.actor.num_actors)
                await client.aclose()
                return
            self.engine = VLLMEngine(cfg.model, cfg.actor, cfg.model.path, seed=cfg.actor.seed)
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, self.stop.set)
        store, gate = WeightStore(client, keys), update_gate("interrupt", self.engine)
        beats = asyncio.create_task(beating(progressing=lambda: gate.stalled_s() < 2.0))  # common/liveness.py
        weights_dir = tempfile.mkdtemp(prefix="omrl-eval-weights-")
        # With the broadcast transport a member thread stages every version as it comes, whatever
        # the evaluation is doing: no other member waits for this one.
        link = BroadcastLink(f"{self.name}|{self.incarnation}", weights_dir, cfg.weights.timeout_s)
        members, announcements = Membership(client, keys), Announcements(client, keys)
        every, done = cfg.learner.eval_every, -1  # the last slot (version // every) evaluated or left to another

        async def claim(slot: int) -> bool:
            return await retry.run("claim the evaluation", lambda: claim_eval(client, keys, slot, self.name))
        log.info("evaluator %s: %d held-out tasks every %d versions", self.name, len(self.tasks), every)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
                env = EnvClient(cfg.env.base_url, session, cfg.env.timeout_s, spec_of(cfg.env), cfg.env.reuse_instances)
                setup = EpisodeSetup(env, self.engine.tokenizer, cfg.actor, self.template, cfg.env.name, self.task_data)
                # Greedy, on the version being evaluated (_evaluate sets it before each evaluation).
                self.policy, gateway = PinnedModelPolicy(self.engine, -1, 0.0), None
                if self.agent is not None:
                    gateway, self.rollouts = await serve_agents(cfg, self.engine, self.policy, self.agent,
                                                                self.task_data, evaluator=True)
                async with asyncio.TaskGroup() as tg:
                    beat = tg.create_task(self._heartbeat(members, gate))
                    while not self.stop.is_set():
                        newest = await retry.run("read the weight version", store.latest)
                        due = newest is not None and newest["version"] // every > done
                        if due and not await claim(newest["version"] // every):
                            done = newest["version"] // every  # another evaluator has it: no load for it
                            log.info("version %d: another evaluator took it", newest["version"])
                        elif due:  # a version is due, and this evaluator's: load it
                            try:
                                await apply_newest(store, gate, self.engine.load_weights, weights_dir, retry, link)
                            except Exception as exc:  # noqa: BLE001 - the next announcement brings another try
                                log.error("weight update failed: %s: %s", type(exc).__name__, first_line(exc))
                        if gate.version >= 0 and not gate.broken and gate.version // every > done:
                            done = gate.version // every  # a newer slot than claimed, if one came meanwhile
                            if await claim(done):
                                await self._evaluate(setup, gate.version, done, client, keys, retry)
                        await first_of(announcements.wait(cfg.actor.weight_poll_s), self.stop.wait())
                    beat.cancel()
                await env.close_kept()
                if gateway is not None:
                    await gateway.cleanup()
        finally:
            beats.cancel()
            await announcements.close()
            await asyncio.to_thread(link.close)
            with contextlib.suppress(*REDIS_TRANSIENT):
                await members.leave(self.name)
            await client.aclose()
            self.engine.shutdown()
            shutil.rmtree(weights_dir, ignore_errors=True)
        log.info("stopped after %d evaluations", self.evaluations)

    async def _evaluate(self, setup: EpisodeSetup, version: int, slot: int, client, keys: Keys,
                        retry: RetryPolicy) -> None:
        """The held-out tasks on `version` (no load until they are done), published tagged with it,
        its slot's claim marked done."""
        started = time.monotonic()
        self.policy.version = version
        play = (lambda task: self.rollouts.run(task, 0)) if self.rollouts is not None else None
        try:
            result = await evaluate(setup, self.policy, self.tasks, "model", play=play)
        except EpisodeError as exc:  # an env or agent failure costs this evaluation; the next version's goes on
            log.warning("evaluation at version %d failed: %s", version, exc)
            return
        record = {"version": version, "last_version": version, "episodes": result.episodes,
                  "success": result.success, "success_ci": list(result.success_ci), "reward": result.reward,
                  "reward_ci": list(result.reward_ci), "invalid_action_frac": result.invalid_action_frac,
                  "seconds": round(time.monotonic() - started, 3)}
        await retry.run("report the evaluation", lambda: finish_eval(client, keys, slot, self.name, record))
        self.evaluations, self.last = self.evaluations + 1, record
        log.info("evaluation at version %d on %d held-out tasks: success %.3f, reward %.3f (%.1f s)",
                 version, result.episodes, result.success, result.reward, record["seconds"])

    async def _heartbeat(self, members: Membership, gate) -> None:
        while not self.stop.is_set():
            try:
                await members.heartbeat(self.name, role="evaluator", host=socket.gethostname(), pid=os.getpid(),
                                        version=gate.version, evaluations=self.evaluations,
                                        last_version=self.last["version"] if self.last else None)
            except REDIS_TRANSIENT as exc:
                log.warning("heartbeat failed: %s", exc)
            await wait_set(self.stop, self.cfg.actor.heartbeat_s)


def place_on_gpus(cfg: Config) -> bool:
    """With actor.gpu_by_index and more GPUs visible than its engine takes (compose's evaluator-gpu
    sees them all), narrow CUDA_VISIBLE_DEVICES to those the learner's ranks and the actors leave
    it (common/gpus.py, the rule `omrl run` places it by); False where they leave none."""
    if not cfg.actor.gpu_by_index or len(visible_gpus()) <= cfg.actor.tensor_parallel_size:
        return True
    devices = evaluator_devices(cfg)
    if devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
        log.info("the evaluator's engine uses GPU %s", devices)
    return devices is not None


def main(cfg: Config) -> None:
    if not cfg.learner.eval_every:  # exit 0: a compose service with evaluation off stays down
        log.info("evaluation is off (learner.eval_every = 0): the evaluator has nothing to do")
        return
    asyncio.run(Evaluator(cfg).run())
