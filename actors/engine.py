"""Inference engines behind one small interface: `generate` one continuation of a token
list with per-token log-probs, and `load_weights` from a safetensors file in place."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from typing import Any, Protocol

from common.config import ActorConfig, ModelConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"


class Engine(Protocol):
    tokenizer: Any

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float | None = None) -> Generation:
        """One continuation; `temperature` overrides actor.temperature (0: greedy)."""

    async def load_weights(self, path: str) -> None: ...

    def shutdown(self) -> None: ...


def share_cpus() -> None:
    """On CPU, several actors share the machine: one OpenMP thread each, unpinned, that
    sleeps rather than spins when idle (2.6x the request rate measured on 2 cores). Set
    before vLLM starts; a value already in the environment wins."""
    for var, value in (("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("OMP_NUM_THREADS", "1"),
                       ("OMP_WAIT_POLICY", "PASSIVE")):
        os.environ.setdefault(var, value)


def engine_args(model: ModelConfig, actor: ActorConfig, model_path: str, seed: int) -> dict[str, Any]:
    """vLLM's engine arguments for an actor, the weight-reload extension apart (what the
    engine benchmark's offline baseline starts `vllm.LLM` with, too)."""
    # Behaviour log-probs must be those of the distribution sampled from, as the learner scores
    # tokens: vLLM's default ("raw_logprobs") takes them before temperature, "processed_logprobs"
    # after it (and after top-k/top-p, which the actors leave off). Greedy requests (temperature 0)
    # get the raw logits' log-probs either way, which the learner scores at temperature 1.
    return dict(model=model_path, dtype=model.dtype, enforce_eager=True, seed=seed, max_model_len=actor.max_seq_len,
                kv_cache_memory_bytes=actor.kv_cache_mb * 1024 * 1024, disable_log_stats=True,
                logprobs_mode="processed_logprobs")


class VLLMEngine:
    """vLLM's AsyncLLM, one request per turn, log-prob of every sampled token."""

    def __init__(self, model: ModelConfig, actor: ActorConfig, model_path: str, seed: int):
        share_cpus()
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**engine_args(model, actor, model_path, seed),
                               worker_extension_cls="actors.vllm_ext.WeightReloadExtension")
        self.llm = AsyncLLM.from_engine_args(args)
        self.tokenizer = self.llm.tokenizer
        stop_ids = [self.tokenizer.convert_tokens_to_ids(t) for t in self._stop_tokens(actor.stop)]
        self.params = dict(temperature=actor.temperature, logprobs=0, stop_token_ids=stop_ids,
                           output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
        self._SamplingParams = SamplingParams
        self._ids = itertools.count()

    def _stop_tokens(self, stop: list[str]) -> list[str]:
        """Stop strings must be single tokens, so the stop token stays in the buffer as sampled."""
        tokens = []
        for text in stop:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(f"actor.stop entry {text!r} is {len(ids)} tokens for this tokenizer; use single-token stops")
            tokens.append(self.tokenizer.convert_ids_to_tokens(ids[0]))
        return tokens

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float | None = None) -> Generation:
        params = self._SamplingParams(max_tokens=max_tokens,
                                      **{**self.params, **({} if temperature is None else {"temperature": temperature})})
        final = None
        async for out in self.llm.generate({"prompt_token_ids": prompt_ids}, params, request_id=f"r{next(self._ids)}"):
            final = out
        completion = final.outputs[0]
        logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)]
        return Generation(list(completion.token_ids), logprobs, completion.finish_reason or "length")

    async def load_weights(self, path: str) -> None:
        await self.llm.collective_rpc("omrl_reload_weights", args=(path,))

    def shutdown(self) -> None:
        self.llm.shutdown()
