"""The token-exact episode loop.

One growing token buffer per episode: the prompt, then every generated token exactly as
the engine sampled it (mask 1, its behaviour log-prob and weight version), then every
observation's tokens (mask 0). Nothing generated is ever re-tokenised.

Each turn the action template reads the action out of the generated text; one that does
not parse is answered as AgentGym's clients answer it (no server call, "Invalid Action."
and the last observation, reward 0). At the end the env's success rule and the configured
reward functions score the episode. An env failure raises (an `EnvError`); the caller fails
the episode's whole group.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import numpy as np

from actors.engine import Engine, Generation
from actors.templates import INVALID_ACTION, ActionTemplate
from actors.weights import WeightGate
from common.config import ActorConfig
from common.messages import Sample
from envs.client import EnvClient
from envs.rewards import Episode, combine


class TokenBuffer:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def add_context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_generated(self, ids: list[int], logprobs: list[float], version: int) -> None:
        self.tokens += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += [version] * len(ids)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass
class Turn:
    """One turn of a policy: the tokens it generated (their log-probs and weight version), and
    the action when the policy chose it directly (None: the template reads it from the text)."""

    generation: Generation
    version: int
    action: str | None = None


class Policy(Protocol):
    async def act(self, tokens: list[int], budget: int, env_id: int) -> Turn: ...


class ModelPolicy:
    """The engine samples; the weight gate makes every call run on one weight version."""

    def __init__(self, engine: Engine, gate: WeightGate):
        self.engine, self.gate = engine, gate

    async def act(self, tokens: list[int], budget: int, env_id: int) -> Turn:
        async with self.gate.generating() as version:
            return Turn(await self.engine.generate(tokens, budget), version)


@dataclasses.dataclass
class EpisodeSetup:
    """What every episode of one actor (or one evaluation) shares."""

    env: EnvClient
    tokenizer: object
    cfg: ActorConfig
    template: ActionTemplate
    env_name: str

    @property
    def prompt(self) -> str:
        instructions = self.template.instructions
        return self.cfg.system_prompt + (instructions + "\n" if instructions else "")


async def run_episode(setup: EpisodeSetup, policy: Policy, task_idx: int) -> Sample:
    cfg, env, spec = setup.cfg, setup.env, setup.env.spec
    encode = lambda text: setup.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    started = time.monotonic()
    gen_s = env_s = 0.0
    buf = TokenBuffer()
    turn_rewards: list[float] = []
    valid: list[bool] = []
    finish, done, info = "max_turns", False, {}
    env_id = await env.create()
    try:
        first = await env.reset(env_id, task_idx)
        observation, total = first.observation, first.reward
        buf.add_context(encode(setup.prompt + observation))
        for _turn in range(cfg.max_turns):
            budget = min(cfg.max_tokens, cfg.max_seq_len - len(buf))
            if budget <= 0:
                finish = "context"
                break
            t0 = time.monotonic()
            turn = await policy.act(buf.tokens, budget, env_id)
            t1 = time.monotonic()
            buf.add_generated(turn.generation.token_ids, turn.generation.logprobs, turn.version)
            text = setup.tokenizer.decode(turn.generation.token_ids, skip_special_tokens=True)
            action = turn.action if turn.action is not None else setup.template.parse(text)
            valid.append(action is not None)
            if action is None:  # AgentGym's convention: no server call
                turn_rewards.append(0.0)
                next_text = INVALID_ACTION + observation
            else:
                result = await env.step(env_id, spec.tidy(action))
                turn_rewards.append(result.reward - total if spec.reward_is_total else result.reward)
                total = result.reward if spec.reward_is_total else total + result.reward
                observation, done, info = result.observation, result.done, result.info
                next_text = observation
            env_s += time.monotonic() - t1
            gen_s += t1 - t0
            if done:
                finish = "done"
                break
            obs_ids = encode(next_text)
            if len(buf) + len(obs_ids) >= cfg.max_seq_len:
                finish = "context"
                break
            buf.add_context(obs_ids)
    finally:
        await env.close_quietly(env_id)
    episode = Episode(turn_rewards=turn_rewards, valid_actions=valid, success=spec.succeeded(done, total, info),
                      generated_tokens=sum(buf.loss_mask), token_budget=cfg.max_turns * cfg.max_tokens,
                      finish_reason=finish)
    return Sample(
        tokens=np.asarray(buf.tokens, np.int32),
        loss_mask=np.asarray(buf.loss_mask, np.uint8),
        logprobs=np.asarray(buf.logprobs, np.float32),
        versions=np.asarray(buf.versions, np.int32),
        reward=combine(cfg.rewards, episode),
        turn_rewards=np.asarray(turn_rewards, np.float32),
        num_turns=len(turn_rewards),
        finish_reason=finish,
        task_id=str(task_idx),
        env_name=setup.env_name,
        success=episode.success,
        invalid_actions=len(valid) - sum(valid),
        timing={"total_s": time.monotonic() - started, "generate_s": gen_s, "env_s": env_s},
    )
