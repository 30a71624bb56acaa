"""The actor process: a vLLM engine, env clients and a producer. Runs `concurrent_groups`
group loops; each takes a task, runs G episodes of it concurrently and pushes one group."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import time

import aiohttp

from actors.engine import VLLMEngine
from actors.episode import run_episode
from actors.weights import WeightGate, receive_weights
from broker.admission import Admission
from broker.connection import connect
from broker.keys import Keys
from broker.membership import Membership
from broker.retry import REDIS_TRANSIENT, RetryPolicy
from broker.streams import RolloutProducer
from broker.weights import WeightStore
from common.config import Config
from common.messages import RolloutGroup, encode_group
from envs.client import EnvClient

log = logging.getLogger(__name__)


class Actor:
    def __init__(self, cfg: Config, index: int = 0):
        if not cfg.model.path:
            raise SystemExit("error: model.path is unset: pass --set model.path=DIR (see `omrl init-model`)")
        if not cfg.redis.url:
            raise SystemExit("error: redis.url is unset: pass --set redis.url=redis://HOST:PORT/0")
        self.cfg, self.index = cfg, index
        self.actor_id = f"{socket.gethostname()}-{os.getpid()}-{index}"
        self.rng = random.Random(cfg.actor.seed + index)
        self.stop = asyncio.Event()
        self.groups = self.tokens = 0
        self._tokens_per_s = 0.0
        self.in_flight = 0  # episodes running now

    async def run(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        self.engine = VLLMEngine(cfg.model, cfg.actor, cfg.model.path, seed=cfg.actor.seed + self.index)
        self.tokenizer = self.engine.tokenizer
        keys = Keys(cfg.redis.run, cfg.redis.shards)
        client = connect(cfg.redis)
        self.retry = RetryPolicy(attempts=cfg.redis.retry_attempts)
        self.producer = RolloutProducer(client, keys, cfg.redis.max_stream_len, cfg.redis.producer_buffer, self.retry)
        self.admission = Admission(client, keys, cfg.learner.groups_per_step, cfg.learner.eta)
        self.members = Membership(client, keys)
        store = WeightStore(client, keys)
        self.gate = WeightGate(version=0)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
                self.env = EnvClient(cfg.env.base_url, session)
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(receive_weights(store, self.gate, self.engine.load_weights,
                                                   cfg.actor.weight_poll_s, self.stop, self.retry))
                    tg.create_task(self._progress())
                    tg.create_task(self._heartbeat())
                    flusher = tg.create_task(self.producer.run())  # if it fails, the actor fails
                    loops = [tg.create_task(self._group_loop()) for _ in range(cfg.actor.concurrent_groups)]
                    tg.create_task(self._drain(loops, flusher))
        finally:
            await client.aclose()
            self.engine.shutdown()
        log.info("stopped after %d groups", self.groups)

    async def _group_loop(self) -> None:
        cfg = self.cfg
        while not self.stop.is_set():
            if not await self.retry.run("admission ticket", lambda: self.admission.acquire(self.stop)):
                return
            task_idx = self.rng.randrange(cfg.env.num_tasks)
            self.in_flight += cfg.actor.group_size
            try:
                samples = await asyncio.gather(*[
                    run_episode(self.engine, self.env, self.tokenizer, self.gate, cfg.actor, task_idx, cfg.env.name)
                    for _ in range(cfg.actor.group_size)])
            finally:
                self.in_flight -= cfg.actor.group_size
            group = RolloutGroup(task_id=str(task_idx), env_name=cfg.env.name, actor_id=self.actor_id,
                                 sampling={"temperature": cfg.actor.temperature, "max_tokens": cfg.actor.max_tokens},
                                 samples=samples)
            await self.producer.push(encode_group(group))
            self.groups += 1
            self.tokens += sum(int(s.loss_mask.sum()) for s in samples)

    async def _drain(self, loops: list[asyncio.Task], flusher: asyncio.Task) -> None:
        """On stop, let running groups finish and the local buffer reach Redis for drain_s,
        then cancel what is left."""
        await self.stop.wait()
        log.info("stopping: finishing the groups in flight (at most %.0fs)", self.cfg.actor.drain_s)
        deadline = asyncio.get_running_loop().time() + self.cfg.actor.drain_s
        _done, pending = await asyncio.wait(loops, timeout=self.cfg.actor.drain_s)
        for task in pending:
            task.cancel()
        try:
            await asyncio.wait_for(self.producer.flush(), max(0.1, deadline - asyncio.get_running_loop().time()))
        except asyncio.TimeoutError:
            log.warning("stopping with %d groups not yet written to Redis", self.producer.buffered)
        flusher.cancel()
        await self.members.leave(self.actor_id)

    async def _heartbeat(self) -> None:
        while not self.stop.is_set():
            try:
                await self.members.heartbeat(self.actor_id, role="actor", host=socket.gethostname(), pid=os.getpid(),
                                             version=self.gate.version, groups=self.groups,
                                             tokens_per_s=round(self._tokens_per_s, 1))
            except REDIS_TRANSIENT as exc:  # a missed heartbeat is not worth stopping for
                log.warning("heartbeat failed: %s", exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.cfg.actor.heartbeat_s)

    async def _progress(self, every_s: float = 10.0) -> None:
        last = (time.monotonic(), 0, 0)
        while not self.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), every_s)
            now = time.monotonic()
            dt = now - last[0]
            self._tokens_per_s = (self.tokens - last[2]) / dt
            log.info("groups=%d groups/s=%.2f gen_tokens/s=%.0f weight_version=%d versions_applied=%d "
                     "in_flight_episodes=%d waited_on_stream=%.1fs waited_on_tickets=%.1fs buffered=%d", self.groups,
                     (self.groups - last[1]) / dt, self._tokens_per_s, self.gate.version, self.gate.applied,
                     self.in_flight, self.producer.waited_s, self.admission.waited_s, self.producer.buffered)
            last = (now, self.groups, self.tokens)


def main(cfg: Config, index: int = 0) -> None:
    asyncio.run(Actor(cfg, index).run())
