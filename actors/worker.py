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
from broker.keys import Keys
from broker.streams import RolloutProducer, connect
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
        self.groups = self.episodes = self.tokens = 0

    async def run(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        self.engine = VLLMEngine(cfg.model, cfg.actor, cfg.model.path, seed=cfg.actor.seed + self.index)
        self.tokenizer = self.engine.tokenizer
        keys = Keys(cfg.redis.run)
        client = connect(cfg.redis.url)
        self.producer = RolloutProducer(client, keys, cfg.redis.max_stream_len)
        store = WeightStore(client, keys)
        self.gate = WeightGate(version=0)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
                self.env = EnvClient(cfg.env.base_url, session)
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(receive_weights(store, self.gate, self.engine.load_weights,
                                                   cfg.actor.weight_poll_s, self.stop))
                    tg.create_task(self._progress())
                    loops = [tg.create_task(self._group_loop()) for _ in range(cfg.actor.concurrent_groups)]
                    tg.create_task(self._drain(loops))
        finally:
            await client.aclose()
            self.engine.shutdown()
        log.info("stopped after %d groups", self.groups)

    async def _group_loop(self) -> None:
        cfg = self.cfg
        while not self.stop.is_set():
            task_idx = self.rng.randrange(cfg.env.num_tasks)
            samples = await asyncio.gather(*[
                run_episode(self.engine, self.env, self.tokenizer, self.gate, cfg.actor, task_idx, cfg.env.name)
                for _ in range(cfg.actor.group_size)])
            group = RolloutGroup(task_id=str(task_idx), env_name=cfg.env.name, actor_id=self.actor_id,
                                 sampling={"temperature": cfg.actor.temperature, "max_tokens": cfg.actor.max_tokens},
                                 samples=samples)
            await self.producer.push(encode_group(group))
            self.groups += 1
            self.episodes += len(samples)
            self.tokens += sum(int(s.loss_mask.sum()) for s in samples)

    async def _drain(self, loops: list[asyncio.Task]) -> None:
        """On stop, let running groups finish for drain_s, then cancel what is left."""
        await self.stop.wait()
        log.info("stopping: finishing the groups in flight (at most %.0fs)", self.cfg.actor.drain_s)
        _done, pending = await asyncio.wait(loops, timeout=self.cfg.actor.drain_s)
        for task in pending:
            task.cancel()

    async def _progress(self, every_s: float = 10.0) -> None:
        last = (time.monotonic(), 0, 0)
        while not self.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), every_s)
            now = time.monotonic()
            dt = now - last[0]
            log.info("groups=%d groups/s=%.2f gen_tokens/s=%.0f weight_version=%d versions_applied=%d "
                     "waited_on_stream=%.1fs", self.groups, (self.groups - last[1]) / dt, (self.tokens - last[2]) / dt,
                     self.gate.version, self.gate.applied, self.producer.waited_s)
            last = (now, self.groups, self.tokens)


def main(cfg: Config, index: int = 0) -> None:
    asyncio.run(Actor(cfg, index).run())
