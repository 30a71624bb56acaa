"""Inference engines behind one small interface: `generate` one continuation of a token
list with per-token log-probs; `load_weights` from a safetensors file in place (whatever
the transport: a broadcast version is staged as a file first); `pause` (running requests
return what they have, finish reason "abort"; or, kept, wait with their KV cache) and
`resume` around an in-flight update."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

from actors.choices import EXTRA_ARG, Choices
from common.config import ActorConfig, ModelConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop", "length", or "abort" (an update interrupted it: continue it)
    swaps: list[int] = dataclasses.field(default_factory=list)
    """Updates that kept this request running (`pause(keep=True)`): how many of its tokens it
    had at each, in order; the tokens after one were sampled by the weights it loaded."""


class Engine(Protocol):
    tokenizer: Any

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float | None = None,
                       turn_start: int | None = None, sent: Callable[[], None] | None = None,
                       stops: list[str] | None = None, choices: Choices | None = None) -> Generation:
        """One continuation; `temperature` overrides actor.temperature (0: greedy), `stops` the
        engine's stop strings (actor.stop; [] for none), `choices` the token sequences it must be
        one of (actor.constrain_actions; actors/choices.py). Tokens of `prompt_ids` from `turn_start`
        on were generated earlier in this turn (a continuation after an update): a stop sequence
        may begin among them. `sent` is called once the request is in the engine (the weight
        gate's `sent`)."""

    async def load_weights(self, path: str) -> None: ...

    def shutdown(self) -> None: ...


def share_cpus() -> None:
    """On CPU, several actors share the machine: one OpenMP thread each, unpinned, that
    sleeps rather than spins when idle (2.6x the request rate measured on 2 cores). oneDNN's
    process-wide cache of compiled kernels is off: vLLM's CPU matmuls keep 32 a layer of their
    own, and the global one kept up to 1,024 more, one for each new token count a batch brought:
    the worker grew +238 MB in 8 minutes with it, +1 without, at x1.05 the calls/s
    (`omrl bench onednn`). Set before vLLM starts; a value already in the environment wins."""
    for var, value in (("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("OMP_NUM_THREADS", "1"),
                       ("OMP_WAIT_POLICY", "PASSIVE"), ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")):
        os.environ.setdefault(var, value)


# The engine's worker in the engine core's process, as vLLM does with one GPU. On CPU vLLM puts
# it in a process of its own ("mp"), which imports torch and vLLM again (about 15 s a start)
# and whose queue spins (sched_yield) for a second after every message: on 2 cores a 3-step
# `omrl run` took 69 s that way and 46 s this way, with twice the groups/s. vLLM turns the
# name "uni" into "mp" on CPU, so the class is named by its path. (The OpenMP threads it would
# set up in that process are ours: share_cpus.)
UNIPROC = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_args(model: ModelConfig, actor: ActorConfig, model_path: str, seed: int) -> dict[str, Any]:
    """vLLM's engine arguments for an actor, the weight-reload extension apart (what the
    engine benchmark's offline baseline starts `vllm.LLM` with, too)."""
    cpu = on_cpu()
    kv_mb = actor.kv_cache_mb if actor.kv_cache_mb is not None else 64 if cpu else None
    # Behaviour log-probs must be those of the distribution sampled from, as the learner scores
    # tokens: vLLM's default ("raw_logprobs") takes them before temperature, "processed_logprobs"
    # after it (and after top-k/top-p, which the actors leave off). Greedy requests (temperature 0)
    # get the raw logits' log-probs either way, which the learner scores at temperature 1.
    args = dict(model=model_path, dtype=model.dtype, seed=seed,
                enforce_eager=cpu if actor.enforce_eager is None else actor.enforce_eager,
                max_model_len=actor.max_model_len or actor.max_seq_len,
                tensor_parallel_size=actor.tensor_parallel_size, enable_prefix_caching=actor.enable_prefix_caching,
                gpu_memory_utilization=actor.gpu_memory_utilization, disable_log_stats=True,
                logprobs_mode="processed_logprobs")
    if actor.constrain_actions:  # the mask comes after the raw logits, so its log-probs are the masked ones
        from actors.vllm_choices import ChoiceLogitsProcessor

        args["logits_processors"] = [ChoiceLogitsProcessor]
    if kv_mb is not None:
        args["kv_cache_memory_bytes"] = kv_mb * 1024 * 1024
    if cpu and actor.tensor_parallel_size == 1:
        args["distributed_executor_backend"] = UNIPROC
    return args


def check_stops(stop: list[str]) -> list[str]:
    """actor.stop, refused where an entry is empty (it would end every turn at once)."""
    for text in stop:
        if not text:
            raise ValueError(f"actor.stop entry {text!r} is empty: remove it")
    return list(stop)


def find_stop(decode: Callable[[list[int]], str], tokens: list[int], stops: list[str], new_from: int) -> int | None:
    """The fewest of `tokens` whose text holds a stop string ending past the text of
    tokens[:new_from] (checked before, or not this request's: in a continued turn a stop may
    begin in those tokens and end in the new ones), or None. Matched on the decoded text, as
    a user writes stop strings: with a BPE tokenizer a "\\n" can sit inside another token
    (".\\n"), which no match on the string's own token ids would see."""
    # A stop string ending past tokens[:new_from] begins at most len(stop) characters before it: decode
    # a window that reaches that far back (a token is at least a character, but for a split multi-byte
    # one), so a long turn costs the same per token as a short one.
    lo = max(0, new_from - max(len(stop) for stop in stops) - 8)
    base = len(decode(tokens[lo:new_from]))
    for end in range(new_from + 1, len(tokens) + 1):
        text = decode(tokens[lo:end])
        if any(text.find(stop, max(0, base - len(stop) + 1)) >= 0 for stop in stops):
            return end
    return None


RESET_ATTEMPTS = 6  # to empty the prefix cache after a load, 3 s in all


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
        self.workers = actor.tensor_parallel_size
        self._SamplingParams, self._kinds = SamplingParams, RequestOutputKind
        self._ids = itertools.count()
        self._swaps: dict[str, list[int]] = {}  # the requests in the engine: their token counts at kept updates
        self._loads = 0  # weight loads so far: each request's cache salt, so no request reuses another version's KV
        self._kept = False  # paused with the running requests kept
        self.params = dict(temperature=actor.temperature, logprobs=0, detokenize=False)
        self.constrains = actor.constrain_actions
        self.set_stop(actor.stop)

    def set_stop(self, stop: list[str]) -> None:
        """Stop strings, matched here on the text of the turn as tokens stream in (DELTA outputs;
        without any, vLLM sends one final output)."""
        self.stops = check_stops(stop)

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float | None = None,
                       turn_start: int | None = None, sent: Callable[[], None] | None = None,
                       stops: list[str] | None = None, choices: Choices | None = None) -> Generation:
        stops = self.stops if stops is None else check_stops(stops)
        if choices is not None and not self.constrains:
            raise RuntimeError("a request with choices needs an engine started with actor.constrain_actions = true")
        params = self._SamplingParams(max_tokens=max_tokens, **{
            **self.params, **({} if temperature is None else {"temperature": temperature}),
            "output_kind": self._kinds.DELTA if stops else self._kinds.FINAL_ONLY,
            **({} if choices is None else {"extra_args": {EXTRA_ARG: choices.to_bytes()}})})
        turn = list(prompt_ids[len(prompt_ids) if turn_start is None else turn_start:])  # this turn's tokens
        first = len(turn)  # where this request's tokens begin in it
        logprobs: list[float] = []
        finish, finished = None, False
        request_id = f"r{next(self._ids)}"
        swaps = self._swaps[request_id] = []
        # add_request returns once the request is sent; the engine takes requests and a pause in order.
        # The salt keeps its prompt off cached blocks of requests sent before the last load, and theirs off it.
        try:
            outputs = await self.llm.add_request(
                request_id, {"prompt_token_ids": prompt_ids, "cache_salt": f"w{self._loads}"}, params)
        except BaseException:
            del self._swaps[request_id]
            raise
        if sent is not None:
            sent()
        try:
            while not finished:
                out = outputs.get_nowait() or await outputs.get()
                finished = out.finished
                if not out.outputs:  # vLLM's end-of-stream sentinel
                    continue
                completion = out.outputs[0]
                new = list(completion.token_ids)  # DELTA: the new tokens; FINAL_ONLY: all, once
                checked = len(turn)
                turn += new
                logprobs += [step[tok].logprob for step, tok in zip(completion.logprobs, new)]
                finish = completion.finish_reason
                if stops:
                    end = find_stop(self.tokenizer.decode, turn, stops, checked)
                    if end is not None:
                        del turn[end:], logprobs[end - first:]
                        finish = "stop"
                        break
        finally:
            del self._swaps[request_id]
            if not finished:  # left early (a stop sequence, or cancelled): end it in the engine
                await self.llm.abort(request_id)
        return Generation(turn[first:], logprobs, finish or "length", swaps)

    async def load_weights(self, path: str) -> None:
        """The weights of `path`, in place, and the prefix cache emptied: its KV was computed by
        the old weights, and a prompt that hit it would be labelled with the new version. An
        interrupting update's pause empties it too, a draining one's does not (the gate loads
        once no call is in flight, so every block is free). Paused with requests kept, their
        blocks are in use and it cannot be emptied: each request's cache salt (the loads before
        it) keeps later requests off them; each kept request notes how many tokens it had (the
        worker's count, taken while nothing runs: outputs still on their way to the request's
        stream are counted). A load that fails then aborts the kept requests: they must not go
        on with weights half loaded."""
        try:
            counts = (await self.llm.collective_rpc("omrl_reload_weights", args=(path,)))[0]
        except BaseException:
            if self._kept:
                await self.llm.pause_generation(mode="abort", clear_cache=True)
            raise
        self._loads += 1
        if self._kept:
            for request_id, swaps in self._swaps.items():
                swaps.append(counts.get(request_id, 0))  # not in the worker: never scheduled, no tokens yet
            return
        for attempt in range(RESET_ATTEMPTS):
            if await self.llm.reset_prefix_cache():
                return
            await asyncio.sleep(0.05 * 2 ** attempt)  # an ended request's blocks not yet freed
        raise RuntimeError(f"vLLM kept refusing to empty its prefix cache after loading {path} (blocks still in "
                           f"use): generating now would reuse KV of the old weights")

    async def pause(self, keep: bool = False) -> None:
        """Between decode steps, running requests end now with what they have (finish reason
        "abort"), or with `keep` stay in the engine with their KV cache and go on at `resume`;
        new ones wait either way."""
        await self.llm.pause_generation(mode="keep" if keep else "abort", clear_cache=not keep)
        self._kept = keep

    async def resume(self) -> None:
        self._kept = False
        await self.llm.resume_generation()

    def shutdown(self) -> None:
        """Stops the engine and drops it: vLLM's finaliser fails if it first runs at interpreter
        exit (`AsyncLLM.__del__`: "'NoneType' object is not callable"). A second call does nothing."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()
