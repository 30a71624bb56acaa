"""The token-exact episode loop.

One growing token buffer per episode: the prompt, then every generated token exactly as
the engine sampled it (mask 1, its behaviour log-prob and weight version), then every
observation's tokens (mask 0). Nothing generated is ever re-tokenised.
An env failure raises (an `EnvError`); the caller fails the episode's whole group.
"""

from __future__ import annotations

import time

import numpy as np

from actors.engine import Engine
from actors.weights import WeightGate
from common.config import ActorConfig
from common.messages import Sample
from envs.client import EnvClient


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


async def run_episode(engine: Engine, env: EnvClient, tokenizer, gate: WeightGate, cfg: ActorConfig,
                      task_idx: int, env_name: str) -> Sample:
    started = time.monotonic()
    gen_s = env_s = 0.0
    buf = TokenBuffer()
    turn_rewards: list[float] = []
    finish = "max_turns"
    env_id = await env.create()
    try:
        observation = await env.reset(env_id, task_idx)
        buf.add_context(tokenizer.encode(cfg.system_prompt + observation, add_special_tokens=False))
        for _turn in range(cfg.max_turns):
            budget = min(cfg.max_tokens, cfg.max_seq_len - len(buf))
            if budget <= 0:
                finish = "context"
                break
            t0 = time.monotonic()
            async with gate.generating() as version:
                gen = await engine.generate(buf.tokens, budget)
            t1 = time.monotonic()
            buf.add_generated(gen.token_ids, gen.logprobs, version)
            action = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            result = await env.step(env_id, action)
            env_s += time.monotonic() - t1
            gen_s += t1 - t0
            turn_rewards.append(result.reward)
            if result.done:
                finish = "done"
                break
            obs_ids = tokenizer.encode(result.observation, add_special_tokens=False)
            if len(buf) + len(obs_ids) >= cfg.max_seq_len:
                finish = "context"
                break
            buf.add_context(obs_ids)
    finally:
        await env.close_quietly(env_id)
    return Sample(
        tokens=np.asarray(buf.tokens, np.int32),
        loss_mask=np.asarray(buf.loss_mask, np.uint8),
        logprobs=np.asarray(buf.logprobs, np.float32),
        versions=np.asarray(buf.versions, np.int32),
        reward=float(sum(turn_rewards)),
        turn_rewards=np.asarray(turn_rewards, np.float32),
        num_turns=len(turn_rewards),
        finish_reason=finish,
        task_id=str(task_idx),
        env_name=env_name,
        timing={"total_s": time.monotonic() - started, "generate_s": gen_s, "env_s": env_s},
    )
