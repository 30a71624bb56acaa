"""The actor process: a vLLM engine, env clients and a producer. Runs `concurrent_groups`
group loops; each takes an admission ticket and a task, runs G episodes of it concurrently
and pushes one group.

A failing env costs one group, never the actor: an env error, an env timeout or an
unreachable env server fails the group (its ticket comes back, counted under the reason)
and the loop goes on; while the env server is unreachable, no new group starts until it
answers again. On SIGTERM the groups in flight may finish for `actor.drain_s` (the rest are
cancelled, their tickets returned as `cancelled`), then the finished groups have
`actor.flush_s` of their own to reach Redis.

With `learner.mode = "async"` a receiver applies each new weight version as it is published,
between generate calls. With `"sync"` there is no receiver: a group, once admitted, first
loads the newest version (admission lets a round of groups start only once the learner has
published the version that trained on the round before), so every group runs on the
learner's current weights.

Every `actor.metrics_s` the actor appends its counters to RUN_DIR/actors/NAME.jsonl, among
them `actor/generating_s`: the time its engine had a generate call in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import random
import shutil
import signal
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable

import aiohttp

from actors.agents import AgentRollouts, load_agent, serve_agents
from actors.engine import Engine, VLLMEngine
from actors.episode import EpisodeSetup, ModelPolicy, run_episode
from actors.sampling import TaskSampler, pools_of
from actors.templates import make_template
from actors.weights import BroadcastLink, apply_newest, receive_weights, update_gate
from broker.admission import Admission
from broker.connection import connect
from broker.keys import Keys
from broker.membership import Membership
from broker.retry import REDIS_TRANSIENT, RetryPolicy
from broker.streams import RolloutProducer
from broker.weights import WeightStore
from common.config import Config, require_set
from common.gpus import gpu_for, visible_gpus
from common.liveness import beating
from common.logs import first_line
from common.messages import CodecError, RolloutGroup, Sample, encode_group
from common.metrics import JsonlSink
from common.retry import wait_set
from envs.base import EpisodeError
from envs.client import EnvClient, EnvError
from envs.rewards import check_weights
from envs.specs import spec_of
from envs.tasks import task_data, task_split

log = logging.getLogger(__name__)


class GroupFailed(Exception):
    """A group that cannot be finished; `reason` is counted (failed:<reason>)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class Actor:
    """`engine` replaces the vLLM engine that `run` builds (tests pass a scripted one)."""

    def __init__(self, cfg: Config, index: int | None = 0, engine: Engine | None = None):
        require_set(cfg, "model.path", "redis.url")
        self.cfg, self.index, self.engine = cfg, index, engine
        try:
            self.template = make_template(cfg.actor.action_template)
            check_weights(cfg.actor.rewards)
            self.train_tasks, _test = task_split(cfg.env)  # no test task is ever trained on
            self.task_data = task_data(cfg.env)
            self.pool_of = pools_of(self.train_tasks, cfg.actor.task_pool, self.task_data)  # a missing column fails here
            # Your own agent plays the episodes through the endpoint (actors/agents.py), or the episode loop does.
            self.agent = load_agent(cfg.actor)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
        self.rollouts: AgentRollouts | None = None
        self.spec = spec_of(cfg.env)
        # The name outlives the process: a restarted actor takes its predecessor's place
        # (membership, and the tickets it left behind come back at once). With no index (a
        # replica of a scaled service) the name is the host's, and the index is a slot that
        # Redis hands out (broker/membership.py).
        self.name = socket.gethostname() if index is None else f"{socket.gethostname()}-{index}"
        self.incarnation = f"{os.getpid()}.{time.time_ns() // 1_000_000}"
        self._ticket_ids = itertools.count()
        self.stop = asyncio.Event()
        self.env_up = asyncio.Event()  # cleared while the env server is unreachable
        self.env_down = asyncio.Event()
        self.groups = self.tokens = 0
        self.failed: Counter[str] = Counter()
        self.running: set[str] = set()  # tickets of the groups running now
        self.asking: set[str] = set()  # of those, the tickets still waiting for admission
        self._tokens_per_s = 0.0
        self.in_flight = 0  # episodes running now
        self._weights_lock = asyncio.Lock()
        # Sync mode: an admitted group first loads the version its round was admitted for.
        self._before_group = self._load_newest_weights if cfg.learner.mode == "sync" else _nothing

    async def run(self) -> None:
        cfg = self.cfg
        keys = Keys(cfg.redis.run, cfg.redis.shards)
        client = connect(cfg.redis)
        self.retry = RetryPolicy(attempts=cfg.redis.retry_attempts)
        self.admission = Admission(client, keys, cfg.learner.groups_per_step, cfg.learner.steps_ahead,
                                   cfg.redis.ticket_ttl_s)
        returned = await self.retry.run("return the tickets of an earlier process",
                                        lambda: self.admission.release_predecessors(self.name, self.incarnation))
        if returned:
            log.warning("%d admission tickets of an earlier process of actor %s came back (counted as actor_lost)",
                        returned, self.name)
        self.producer = RolloutProducer(client, keys, cfg.redis.max_stream_len, cfg.redis.producer_buffer, self.retry,
                                        admission=self.admission)
        self.members = Membership(client, keys)
        slot, starts = await self.retry.run("claim a slot", lambda: self.members.claim_slot(self.name, self.index))
        self.index = slot
        self.start, self.seed = starts + 1, actor_seed(cfg.actor.seed, self.index, starts)
        log.info("actor %s: index %d, start %d, seed %d", self.name, self.index, self.start, self.seed)
        self.rng = random.Random(self.seed)
        self.sampler = TaskSampler(self.train_tasks, self.rng, cfg.actor.task_sampling, self.pool_of,
                                   cfg.actor.spread_floor)
        if cfg.actor.gpu_by_index:
            pick_gpu(self.index, cfg.learner.ranks)
        if self.engine is None:
            # The engine's start holds this loop for a minute or more: one heartbeat first, so that
            # the learner reads this actor as starting, not dead, for up to supervisor.start_grace_s.
            await self.retry.run("say it is starting", lambda: self.members.heartbeat(
                self.name, **self._member_info(version=-1), state="starting", quiet_s=cfg.supervisor.start_grace_s))
            self.engine = VLLMEngine(cfg.model, cfg.actor, cfg.model.path, seed=self.seed)
        self.tokenizer = self.engine.tokenizer
        # Until here a signal ends the process at once (it holds nothing); from here it drains.
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, self.stop.set)
        self.store = WeightStore(client, keys)
        self.gate = update_gate(cfg.actor.update_mode, self.engine)
        # Progress: the loop turns and the engine finishes what it is given (a wedged one stops this).
        beats = asyncio.create_task(beating(progressing=lambda: self.gate.stalled_s() < 2.0))
        # The transport is the learner's choice, read from each version's record.
        self.weights_dir = tempfile.mkdtemp(prefix="omrl-weights-")
        self.link = BroadcastLink(f"{self.name}|{self.incarnation}", self.weights_dir, cfg.weights.timeout_s)
        try:
            with contextlib.suppress(GroupFailed):  # the receiver (or the next group) tries again
                await self._load_newest_weights()  # start on the current version
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
                self.env = EnvClient(cfg.env.base_url, session, cfg.env.timeout_s, self.spec, cfg.env.reuse_instances)
                self.setup = EpisodeSetup(self.env, self.tokenizer, cfg.actor, self.template, cfg.env.name,
                                          self.task_data)
                self.policy = ModelPolicy(self.engine, self.gate)
                gateway = None
                if self.agent is not None:
                    gateway, self.rollouts = await serve_agents(cfg, self.engine, self.policy, self.agent,
                                                                self.task_data)
                self.env_up.set()
                async with asyncio.TaskGroup() as tg:
                    if cfg.learner.mode == "async":
                        tg.create_task(receive_weights(self.store, self.gate, self.engine.load_weights,
                                                       cfg.actor.weight_poll_s, self.stop, self.retry, self.link))
                    tg.create_task(self._progress())
                    tg.create_task(self._heartbeat())
                    tg.create_task(self._watch_env())
                    flusher = tg.create_task(self.producer.run())  # if it fails, the actor fails
                    loops = [tg.create_task(self._group_loop()) for _ in range(cfg.actor.concurrent_groups)]
                    tg.create_task(self._write_metrics(loops))
                    tg.create_task(self._drain(loops, flusher))
                await self.env.close_kept()  # the instances kept for episodes that will not come
                if gateway is not None:
                    await gateway.cleanup()
        finally:
            beats.cancel()
            await asyncio.to_thread(self.link.close)  # leaves the learner's weight group, if a member
            await client.aclose()
            self.engine.shutdown()
            shutil.rmtree(self.weights_dir, ignore_errors=True)
        log.info("stopped after %d groups (%d failed: %s)", self.groups, sum(self.failed.values()),
                 dict(self.failed) or "none")

    async def _group_loop(self) -> None:
        while not self.stop.is_set():
            if not await _wait_either(self.env_up, self.stop):
                return
            ticket = f"{self.name}|{self.incarnation}|{next(self._ticket_ids)}"
            self.running.add(ticket)  # before the request: a stop during it still returns the ticket
            self.asking.add(ticket)  # not renewed while it waits: nothing to renew yet
            try:
                granted = await self.retry.run("admission ticket", lambda: self.admission.acquire(ticket, self.stop))
            finally:
                self.asking.discard(ticket)
            if not granted:
                self.running.discard(ticket)
                return
            task_idx = self.sampler.draw()
            try:
                await self._before_group()
                group = await self._run_group(task_idx)
                data = encode_group(group)
            except (GroupFailed, CodecError) as exc:  # CodecError: over the size limit, or a sample it refuses
                await self._fail(ticket, exc.reason, f"group of task {task_idx} failed: {exc}")
                if exc.reason == "env_unreachable":
                    self.env_up.clear()
                    self.env_down.set()
                continue
            await self.producer.push(data, ticket)  # the producer commits the ticket after the XADD
            self.running.discard(ticket)
            self.groups += 1
            self.sampler.record(task_idx, group.rewards.tolist())
            self.tokens += sum(int(s.loss_mask.sum()) for s in group.samples)

    async def _load_newest_weights(self) -> None:
        """Apply the newest published version if the engine runs an older one (one load at a
        time: concurrent callers find it applied)."""
        async with self._weights_lock:
            try:
                await apply_newest(self.store, self.gate, self.engine.load_weights, self.weights_dir, self.retry,
                                   self.link)
            except Exception as exc:  # noqa: BLE001 - a failed update costs the group, never the actor
                log.error("weight update failed: %s: %s", type(exc).__name__, first_line(exc))
                if self.gate.broken:
                    raise GroupFailed("weights", f"the weights could not be loaded: {first_line(exc)}") from None

    async def _run_group(self, task_idx: int) -> RolloutGroup:
        """G episodes of one task (the agent's, or the episode loop's); the first env, agent or reward
        failure cancels the others and fails the group."""
        cfg = self.cfg
        self.in_flight += cfg.actor.group_size
        try:
            async with asyncio.TaskGroup() as tg:
                if self.rollouts is not None:  # an episode is the samples of its segments
                    episodes = [tg.create_task(self.rollouts.run(task_idx, i)) for i in range(cfg.actor.group_size)]
                else:
                    episodes = [tg.create_task(_one(run_episode(self.setup, self.policy, task_idx)))
                                for _ in range(cfg.actor.group_size)]
        except* EpisodeError as errors:
            first = errors.exceptions[0]
            raise GroupFailed(first.reason, str(first)) from None
        finally:
            self.in_flight -= cfg.actor.group_size
        played_by = {"agent": cfg.actor.agent_name} if self.rollouts is not None else {
            "action_template": cfg.actor.action_template}
        return RolloutGroup(task_id=str(task_idx), env_name=cfg.env.name, actor_id=self.name,
                            sampling={"temperature": cfg.actor.temperature, "max_tokens": cfg.actor.max_tokens,
                                      **played_by},
                            samples=[s for e in episodes for s in e.result()])

    async def _fail(self, ticket: str, reason: str, message: str) -> None:
        self.failed[reason] += 1
        log.warning("%s (reason %s; %d groups failed so far)", message, reason, sum(self.failed.values()))
        await self.retry.run("return the admission ticket", lambda: self.admission.release(ticket, reason))
        self.running.discard(ticket)

    async def _watch_env(self) -> None:
        """While the env server is unreachable no new group starts: poll it until it answers."""
        while not self.stop.is_set():
            if not await _wait_either(self.env_down, self.stop):
                return
            log.warning("env server %s unreachable: no new groups until it answers", self.cfg.env.base_url)
            delay = 0.5
            while not self.stop.is_set():
                try:
                    await self.env.health(attempts=1)
                    break
                except EnvError:
                    await wait_set(self.stop, delay)
                    delay = min(2 * delay, 10.0)
            log.info("env server %s answers: starting groups again", self.cfg.env.base_url)
            self.env_down.clear()
            self.env_up.set()

    async def _drain(self, loops: list[asyncio.Task], flusher: asyncio.Task) -> None:
        """On stop, let running groups finish for drain_s and cancel the rest (their tickets
        come back as `cancelled`), then give the finished groups flush_s to reach Redis.
        The stream's length bound no longer holds them back: a clean stop loses nothing."""
        await self.stop.wait()
        acfg = self.cfg.actor
        log.info("stopping: finishing the groups in flight (at most %.0fs)", acfg.drain_s)
        _done, pending = await asyncio.wait(loops, timeout=acfg.drain_s) if loops else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for ticket in list(self.running):
            await self._release_quietly(ticket, "cancelled")
        if pending:
            log.info("cancelled %d groups in flight (counted as cancelled)", len(pending))
        self.producer.unbounded.set()
        try:
            await asyncio.wait_for(self.producer.flush(), acfg.flush_s)
        except TimeoutError:
            log.warning("stopping with %d groups not written to Redis (Redis unreachable?): their tickets "
                        "come back when they expire", self.producer.buffered)
        flusher.cancel()
        with contextlib.suppress(*REDIS_TRANSIENT):
            await self.members.leave(self.name)

    async def _release_quietly(self, ticket: str, reason: str) -> None:
        self.running.discard(ticket)
        try:
            if await asyncio.wait_for(self.admission.release(ticket, reason), 2.0):
                self.failed[reason] += 1
        except (TimeoutError, *REDIS_TRANSIENT) as exc:
            log.warning("could not return ticket %s (%s): it comes back when it expires", ticket, exc)

    def _member_info(self, version: int) -> dict:
        """What each heartbeat says of this actor (`omrl status`, the learner's janitor)."""
        return dict(role="actor", host=socket.gethostname(), pid=os.getpid(), index=self.index, start=self.start,
                    seed=self.seed, version=version, groups=self.groups, groups_failed=sum(self.failed.values()),
                    tokens_per_s=round(self._tokens_per_s, 1))

    async def _heartbeat(self) -> None:
        """Heartbeats also renew the tickets this actor holds: running groups and groups
        waiting in the producer's buffer."""
        while not self.stop.is_set():
            try:
                await self.members.heartbeat(self.name, **self._member_info(self.gate.version))
                await self.admission.renew(sorted((self.running - self.asking) | self.producer.tickets))
                await self.members.renew_slot(self.name)
            except REDIS_TRANSIENT as exc:  # a missed heartbeat is not worth stopping for
                log.warning("heartbeat failed: %s", exc)
            await wait_set(self.stop, self.cfg.actor.heartbeat_s)

    async def _write_metrics(self, loops: list[asyncio.Task]) -> None:
        """Counters every actor.metrics_s to RUN_DIR/actors/NAME.jsonl (wall-clock `time`, so
        they line up with the learner's metrics.jsonl), and once more when the drain has ended the
        group loops: the last line holds the final counts, however short the run."""
        sink = JsonlSink(os.path.join(self.cfg.run.run_dir, "actors", f"{self.name}.jsonl"))
        try:
            while True:
                stopped = self.stop.is_set()
                if stopped and loops:
                    await asyncio.wait(loops)
                sink.write({"time": time.time(), "actor/generating_s": self.gate.generating_s,
                            "actor/updates": self.gate.applied, "actor/update_s": self.gate.update_s,
                            "actor/update_blocked_s": self.gate.blocked_s,
                            "actor/groups": self.groups, "actor/gen_tokens": self.tokens,
                            "actor/groups_failed": sum(self.failed.values()),
                            "actor/weight_version": self.gate.version, "actor/in_flight_episodes": self.in_flight,
                            "actor/waited_on_tickets_s": self.admission.waited_s,
                            "actor/task_pools_played": len(self.sampler.played),
                            "actor/task_pools_flat": self.sampler.flat_pools,
                            **({f"actor/agent_{k}": v for k, v in self.rollouts.counts.items()} if self.rollouts else {})})
                if stopped:
                    return
                await wait_set(self.stop, self.cfg.actor.metrics_s)
        finally:
            sink.close()

    async def _progress(self, every_s: float = 10.0) -> None:
        last = (time.monotonic(), 0, 0)
        while not self.stop.is_set():
            await wait_set(self.stop, every_s)
            now = time.monotonic()
            dt = now - last[0]
            self._tokens_per_s = (self.tokens - last[2]) / dt
            log.info("groups=%d groups/s=%.2f gen_tokens/s=%.0f weight_version=%d versions_applied=%d "
                     "in_flight_episodes=%d groups_failed=%d waited_on_stream=%.1fs waited_on_tickets=%.1fs "
                     "buffered=%d", self.groups, (self.groups - last[1]) / dt, self._tokens_per_s, self.gate.version,
                     self.gate.applied, self.in_flight, sum(self.failed.values()), self.producer.waited_s,
                     self.admission.waited_s, self.producer.buffered)
            last = (now, self.groups, self.tokens)


async def _nothing() -> None:
    pass


async def _one(sample: Awaitable[Sample]) -> list[Sample]:
    return [await sample]


async def _wait_either(event: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wait until `event` is set (True) or `stop` is (False)."""
    if event.is_set():
        return not stop.is_set()
    waiters = [asyncio.create_task(event.wait()), asyncio.create_task(stop.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    return event.is_set() and not stop.is_set()


def actor_seed(base: int, index: int, starts: int) -> int:
    """Actor i's first process seeds with base + i; a restarted one (starts > 0) must not
    replay its predecessor's task order and samples, so it mixes in its start count."""
    if starts == 0:
        return base + index
    digest = hashlib.blake2b(f"{base}/{index}/{starts}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def pick_gpu(index: int, learner_ranks: int) -> None:
    """Narrow CUDA_VISIBLE_DEVICES to this actor's GPU before vLLM starts (nothing here has
    touched CUDA yet)."""
    ids = visible_gpus()
    if len(ids) > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu_for(index, learner_ranks, ids)
        log.info("actor index %d uses GPU %s of %s", index, os.environ["CUDA_VISIBLE_DEVICES"], ",".join(ids))


def main(cfg: Config, index: int | None = 0) -> None:
    asyncio.run(Actor(cfg, index).run())
