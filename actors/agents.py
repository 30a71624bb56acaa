"""Your own agent as the rollout: an episode is your agent's code run on one task against the
actor's OpenAI-compatible endpoint (actors/gateway.py), through a session of its own.

Two kinds, named in the config:

- `actor.agent = "my_pkg.agent:rollout"` (or `"path/to/agent.py:rollout"`): an `async def
  rollout(task, client)`, called in the actor's process with the task and an
  `openai.AsyncOpenAI` client whose base URL is the session's; it returns the episode's reward.
- `actor.agent_url = "http://HOST:PORT/rollout"`: a service in any language; the actor POSTs
  `{"task": ..., "base_url": ..., "session": ...}` and reads the reward from the answer's
  `{"reward": ...}`.

`task` is a dict: `task_id` (the env's task index), `env` (its name), `env_url` (its server,
which speaks the AgentGym protocol) and `data` (the task file's other columns, {} without one).

The reward: what the agent returns (a number, or `{"reward": r, "success": bool}`), else the
sum of the rewards it posted to `POST .../sessions/KEY/reward` (each kept on the call it came
after). The episode's reward is then `actor.rewards` over it, as for the env loop: `env` (the
default) is the agent's reward, other reward functions see every call's text. An agent that
raises, times out (`actor.agent_timeout_s`), answers an error, made no call, or reports no
reward fails its group with the reason (agent_error, agent_timeout, agent_no_calls,
agent_no_reward); it never becomes a reward of 0.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import logging
import math
import numbers
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from actors.engine import Engine
from actors.episode import Policy
from actors.gateway import Gateway, Session
from common.config import ActorConfig, Config
from common.http import runner_for
from common.logs import first_line
from common.messages import Sample
from envs.base import EpisodeError
from envs.rewards import Episode, EpisodeTurn, combine

log = logging.getLogger(__name__)

AgentCall = Callable[[dict[str, Any], str, str], Awaitable[Any]]
"""(task, the session's base URL, its key) -> what the agent answered."""


class AgentError(EpisodeError):
    """The agent failed an episode; its group fails, counted under `reason`."""

    def __init__(self, message: str, reason: str = "agent_error"):
        super().__init__(message)
        self.reason = reason


def load_agent(cfg: ActorConfig) -> AgentCall | None:
    """The agent the config names, as one call: the Python callable (actor.agent) with an
    openai client on the session, or a POST to the service (actor.agent_url); None where it
    names none. A name that does not import raises ValueError naming the field (the actor's
    start, and omrl run's checks)."""
    if not cfg.agent_name:
        return None
    if cfg.agent_url:
        return lambda task, base_url, key: _post(cfg.agent_url, {"task": task, "base_url": base_url, "session": key})
    module, _, name = cfg.agent.rpartition(":")
    try:
        fn = getattr(import_named(module), name)
        from openai import AsyncOpenAI
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises, named with the field
        raise ValueError(f"actor.agent = {cfg.agent!r} cannot be loaded ({type(exc).__name__}: {exc}): put its "
                         f"module on PYTHONPATH (or install its package; it needs openai too) and name an async "
                         f"function in it") from None
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"actor.agent = {cfg.agent!r} is not an async function: write it as "
                         f"`async def rollout(task, client)`")
    clients: list[AsyncOpenAI] = []  # one HTTP client for every session, made in the actor's event loop

    def call(task: dict[str, Any], base_url: str, key: str) -> Awaitable[Any]:
        if not clients:
            clients.append(AsyncOpenAI(base_url=base_url, api_key="openmanus-rl", timeout=cfg.agent_timeout_s))
        return fn(task, clients[0].with_options(base_url=base_url))

    return call


def import_named(name: str) -> ModuleType:
    """A module by its import name, or by its file's path (a name ending in .py)."""
    if not name.endswith(".py"):
        return importlib.import_module(name)
    path = Path(name).resolve()
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or not path.is_file():
        raise ImportError(f"no file {name}")
    if str(path.parent) not in sys.path:  # the files beside it import as they would run from there
        sys.path.insert(0, str(path.parent))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses, pickle and pydantic look it up there
    spec.loader.exec_module(module)
    return module


async def _post(url: str, body: dict) -> Any:
    """The service's answer to one episode (actor.agent_timeout_s bounds it from outside)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        async with http.post(url, json=body) as response:
            text = await response.text()
    if response.status >= 400:
        raise AgentError(f"the agent service at {url} answered {response.status}: {text[:300]}")
    try:
        return json.loads(text)
    except ValueError:
        raise AgentError(f"the agent service at {url} answered {text[:300]!r}, not JSON") from None


async def serve_agents(cfg: Config, engine: Engine, policy: Policy, agent: AgentCall, task_data: dict[int, dict],
                       evaluator: bool = False) -> tuple[web.AppRunner, AgentRollouts]:
    """The endpoint over `engine`, sampling through `policy`, on actor.gateway_host and
    gateway_port, and the agent's episodes through it. Agents reach it at actor.gateway_url, or
    at this host's name where it binds every interface (0.0.0.0: a container's), else at the
    host it binds. The `evaluator`'s takes a free port and its own URL: the actor's port and URL
    are the actors'. A client that leaves cancels its call's generation."""
    acfg = cfg.actor
    gateway = Gateway(engine, policy, acfg.max_seq_len, cfg.model.path)
    runner = runner_for(gateway.app(), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, acfg.gateway_host, 0 if evaluator else acfg.gateway_port).start()
    host = socket.gethostname() if acfg.gateway_host in ("0.0.0.0", "::") else acfg.gateway_host
    url = (not evaluator and acfg.gateway_url) or f"http://{host}:{runner.addresses[0][1]}"
    log.info("the agent %s plays the episodes through the endpoint at %s/sessions/KEY/v1", acfg.agent_name, url)
    return runner, AgentRollouts(acfg, gateway, url, agent, cfg.env.name, cfg.env.base_url, task_data)


class AgentRollouts:
    """Episodes of the configured agent through `gateway`, whose endpoint agents reach at `url`."""

    def __init__(self, cfg: ActorConfig, gateway: Gateway, url: str, agent: AgentCall, env_name: str, env_url: str,
                 task_data: dict[int, dict]):
        self.cfg, self.gateway, self.url, self.agent = cfg, gateway, url.rstrip("/"), agent
        self.env_name, self.env_url, self.task_data = env_name, env_url, task_data
        self.counts = {"calls": 0, "extended": 0, "splits": 0}  # over the sessions so far (the actor's metrics)

    def task(self, task_idx: int) -> dict[str, Any]:
        return {"task_id": task_idx, "env": self.env_name, "env_url": self.env_url,
                "data": self.task_data.get(task_idx, {})}

    async def run(self, task_idx: int, episode: int) -> list[Sample]:
        """One episode: the agent's run on `task_idx` in a session of its own, as the samples of
        its segments (each tagged `episode`, each with the episode's reward)."""
        started = time.monotonic()
        session = self.gateway.open()
        base_url = f"{self.url}/sessions/{session.key}/v1"
        try:
            answer = await asyncio.wait_for(self.agent(self.task(task_idx), base_url, session.key),
                                            self.cfg.agent_timeout_s)
        except TimeoutError:
            raise AgentError(f"the agent took longer than actor.agent_timeout_s={self.cfg.agent_timeout_s:g}s on task "
                             f"{task_idx}", "agent_timeout") from None
        except AgentError:
            raise
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the group's, or the actor's drain: it goes on up
                raise
            raise AgentError(f"the agent's own code was cancelled on task {task_idx}") from None
        except Exception as exc:  # noqa: BLE001 - the user's code: any failure fails the group, with its text
            raise AgentError(f"the agent failed on task {task_idx}: {type(exc).__name__}: {first_line(exc)}") from exc
        finally:
            session = await self.gateway.close(session.key)
            for name in self.counts:
                self.counts[name] += getattr(session, name)
        reward, success = self._reward(answer, session, task_idx)
        return await self._samples(session, task_idx, episode, reward, success, time.monotonic() - started)

    @staticmethod
    def _reward(answer: Any, session: Session, task_idx: int) -> tuple[float, bool | None]:
        """The agent's reward and success: returned, else the sum of those it posted."""
        success = None
        if isinstance(answer, dict):
            success = answer.get("success")
            if success is not None and not isinstance(success, bool):
                raise AgentError(f"the agent's success on task {task_idx} is {success!r}, not true or false")
            answer = answer.get("reward")
        if answer is None:
            if not session.rewards:
                raise AgentError(f"the agent reported no reward on task {task_idx}: return it, or POST it to the "
                                 f"session's .../reward", "agent_no_reward")
            answer = sum(value for _after, value in session.rewards)
        try:
            value = float(answer) if isinstance(answer, numbers.Real) and not isinstance(answer, bool) else math.nan
        except OverflowError:  # an integer too large for a float
            value = math.nan
        if not math.isfinite(value):
            raise AgentError(f"the agent's reward on task {task_idx} is {str(answer)[:100]}, not a finite number")
        return value, success

    async def _samples(self, session: Session, task_idx: int, episode: int, reward: float, success: bool | None,
                       total_s: float) -> list[Sample]:
        if not session.calls:
            raise AgentError(f"the agent made no call to the endpoint on task {task_idx}: nothing to train on",
                             "agent_no_calls")
        # The agent's reward on its calls: each posted one on the call it came after, the rest on the last.
        per_call = [0.0] * session.calls
        for after, value in session.rewards:
            per_call[max(0, after - 1)] += value
        per_call[-1] += reward - sum(per_call)
        texts = session.texts
        turns = [EpisodeTurn(text, text, "", r, False) for text, r in zip(texts, per_call)]
        succeeded = success if success is not None else reward > 0
        generated = sum(sum(s.loss_mask) for s in session.segments)
        scored = Episode(turns=turns, success=succeeded, generated_tokens=generated,
                         token_budget=self.cfg.max_seq_len * session.calls, finish_reason="done", task_idx=task_idx,
                         task=self.task_data.get(task_idx, {}), env_name=self.env_name)
        value = await combine(self.cfg.rewards, scored, self.cfg.reward_timeout_s)
        samples, call = [], 0
        for segment, calls in zip(session.segments, session.segment_calls):
            samples.append(Sample(
                tokens=np.asarray(segment.tokens, np.int32), loss_mask=np.asarray(segment.loss_mask, np.uint8),
                logprobs=np.asarray(segment.logprobs, np.float32), versions=np.asarray(segment.versions, np.int32),
                reward=value, turn_rewards=np.asarray(per_call[call:call + calls], np.float32), num_turns=calls,
                finish_reason="done", task_id=str(task_idx), env_name=self.env_name, success=succeeded,
                timing={"total_s": total_s}, episode=episode))
            call += calls
        return samples
