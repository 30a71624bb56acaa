"""`omrl bench engine`: generated tokens/s of the actor's episode loop (`run_episode` with a
`ModelPolicy` on a `VLLMEngine`, the `letters` env server over HTTP) against the engine
alone on the same requests, and against vLLM's own offline `LLM.generate`.

E concurrent episode loops (64: one actor's 8 groups x 8), each running episodes back to
back as an actor's group loops do. The engine is wrapped to record every request (prompt
token ids, max_tokens) by loop, in order. The recorded requests are then replayed:
- engine alone: the same engine, E loops, each sending its own loop's requests one after
  the other. Turn by turn is the fair replay: in the episode loop a turn cannot be sent
  before the previous one came back, so this keeps the same dependency, the same number of
  requests in flight (at most E) and the same order; what it leaves out is exactly what
  the loop does between turns (env create/reset/step/close over HTTP, decoding and parsing
  the action, the token buffer, the weight gate).
- vLLM offline: `vllm.LLM` with the engine's arguments (and the scheduler limits the async
  engine resolves: max_num_seqs, max_num_batched_tokens), in a subprocess started once,
  one `llm.generate` over all the recorded prompts, with the engine's SamplingParams,
  shortest prompts first (so each turn comes after the turn it extends, whose blocks the
  prefix cache may then hold, as in the loop). No request waits for another: the most
  vLLM makes of this work.
Every measurement starts from an empty prefix cache (the replays' prompts were just
computed by the episode loop).

Two points: the actor's defaults (max_tokens 4, stop "\\n", temperature 1; letters with 2
turns): per-request overheads dominate; and 32 tokens a turn over 6 turns, where decoding
shows. Sampling is at temperature 1 in every path, so generations (and so token counts)
differ a little between paths: each figure is its own generated tokens over its own wall
time. Ratios (higher is better, 1.0: no cost over the baseline):
- episode loop / engine alone: what the env round trips and the loop's own work cost;
- episode loop / offline: what the actor's path gets of what vLLM can do with these prompts;
- engine alone / offline: what one request per turn through AsyncLLM costs (turn-by-turn
  dependency, per-request overhead) against a batch.
- agent / episode loop: what your own agent costs against our loop on the same work: the
  example agent (examples/own-agent/agent.py) plays the same tasks with the same turn
  settings through the OpenAI-compatible endpoint (an HTTP call and the chat template's
  render a turn, the agent's own env calls); issue 29's goal is at least 0.8.
- endpoint / episode loop: the same agent loop written with plain aiohttp and one session
  (no openai client, no tools): what the endpoint itself costs, the client library aside.

On a GPU build of vLLM the engines pick the GPU themselves (vLLM chooses its platform);
`device` is only recorded.

    python -m benchmarks.engine [--quick]        the benchmark, as `omrl bench engine`
    python -m benchmarks.engine --offline CFG    the offline baseline's server (internal)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import alternate, pyplot, ratios, row, spread, wait_http

EPISODES = 64  # concurrent episode loops: one actor's 8 groups x 8
QUICK_EPISODES = 16
# name: actor settings and letters options; rounds: episodes per loop per measurement
POINTS = {
    "defaults": {"actor": {}, "env": {}, "rounds": 32},
    "32 tokens x 6 turns": {"actor": {"max_tokens": 32, "max_turns": 6}, "env": {"turns": 6}, "rounds": 4},
}
QUICK_POINTS = {"defaults": {"actor": {}, "env": {}, "rounds": 1}}
KINDS = ("episode_loop", "engine_alone", "offline", "agent", "endpoint")
LABELS = {"episode_loop": "episode loop (engine + env over HTTP)", "engine_alone": "engine alone (replay)",
          "offline": "vLLM offline generate", "agent": "the example agent (openai client) through the endpoint",
          "endpoint": "the same agent loop, plain aiohttp, through the endpoint"}
PAIRS = (("episode_loop", "engine_alone"), ("episode_loop", "offline"), ("engine_alone", "offline"),
         ("agent", "episode_loop"), ("endpoint", "episode_loop"))
AGENT = Path(__file__).resolve().parents[1] / "examples" / "own-agent" / "agent.py"
FIGURES = ("tokens_per_s", "requests_per_s", "tokens", "requests", "mean_prompt", "seconds")
RESULT = "omrl-offline "  # prefix of the offline server's answers on its stdout

_loop_index: contextvars.ContextVar[int] = contextvars.ContextVar("loop_index")


class RecordingEngine:
    """The engine, recording every request by episode loop (the loop's index is a context
    variable each loop sets), in the order it was sent."""

    def __init__(self, engine, loops: int):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.requests: list[list[tuple[list[int], int]]] = [[] for _ in range(loops)]
        self.generated = 0

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float | None = None,
                       turn_start: int | None = None, sent=None, stops=None, choices=None):
        self.requests[_loop_index.get()].append((list(prompt_ids), max_tokens))  # the buffer grows later
        generation = await self.engine.generate(prompt_ids, max_tokens, temperature, turn_start, sent)
        self.generated += len(generation.token_ids)
        return generation


def _figures(tokens: int, requests: list[tuple[list[int], int]], seconds: float) -> dict:
    return {"tokens_per_s": tokens / seconds, "requests_per_s": len(requests) / seconds, "tokens": tokens,
            "requests": len(requests), "seconds": seconds,
            "mean_prompt": statistics.mean(len(ids) for ids, _ in requests)}


async def episode_loop(setup, engine, loops: int, rounds: int) -> tuple[dict, list]:
    """`loops` episode loops, `rounds` episodes each (loop w plays tasks w, w + loops, ...):
    the figures, and the requests each loop sent."""
    from actors.episode import ModelPolicy, run_episode
    from actors.weights import WeightGate

    recorder = RecordingEngine(engine, loops)
    policy = ModelPolicy(recorder, WeightGate())

    async def one_loop(w: int) -> None:
        _loop_index.set(w)  # this task's own context
        for i in range(rounds):
            await run_episode(setup, policy, w + loops * i)

    started = time.perf_counter()
    await asyncio.gather(*[one_loop(w) for w in range(loops)])
    seconds = time.perf_counter() - started
    flat = [r for per_loop in recorder.requests for r in per_loop]
    return _figures(recorder.generated, flat, seconds), recorder.requests


class CountingEngine:
    """The engine, counting what it was asked and what it generated (the endpoint's requests,
    which come from its handlers: nothing is replayed of them)."""

    def __init__(self, engine):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.generated = self.requests = self.prompt_tokens = 0

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float | None = None,
                       turn_start: int | None = None, sent=None, stops: list[str] | None = None, choices=None):
        self.requests, self.prompt_tokens = self.requests + 1, self.prompt_tokens + len(prompt_ids)
        generation = await self.engine.generate(prompt_ids, max_tokens, temperature, turn_start, sent, stops)
        self.generated += len(generation.token_ids)
        return generation


async def lean_agent(http, task: dict, base_url: str, actor) -> float:
    """The example agent's loop without its libraries: the endpoint and the env over one shared
    aiohttp session, JSON by hand (what the endpoint itself costs, less the openai client's work)."""
    env = task["env_url"]
    async with http.post(f"{env}/create", json={}) as r:
        env_id = (await r.json())["id"]
    async with http.post(f"{env}/reset", json={"id": env_id, "data_idx": task["task_id"]}) as r:
        messages, total = [{"role": "user", "content": (await r.json())["observation"]}], 0.0
    for _ in range(actor.max_turns):
        async with http.post(f"{base_url}/chat/completions", json={
                "model": "policy", "messages": messages, "max_tokens": actor.max_tokens, "stop": actor.stop}) as r:
            text = (await r.json())["choices"][0]["message"]["content"] or ""
        messages.append({"role": "assistant", "content": text})
        async with http.post(f"{env}/step", json={"id": env_id, "action": text}) as r:
            step = await r.json()
        total += float(step["reward"])
        if step["done"]:
            break
        messages.append({"role": "user", "content": step["observation"]})
    async with http.post(f"{env}/close", json={"id": env_id}):
        pass
    return total


async def agent_loops(cfg, engine, loops: int, rounds: int, lean: bool = False) -> dict:
    """`loops` loops of the example agent (examples/own-agent/agent.py, its tiny-model form with
    the point's turn settings; `lean`: `lean_agent`, the same loop without the openai client),
    each playing `rounds` episodes back to back through the endpoint as an actor serves it
    (actors/agents.py): the same tasks as the episode loops, the same engine, each agent
    calling the env server itself and the engine over HTTP."""
    import aiohttp
    from openai import AsyncOpenAI

    from actors.agents import import_named, serve_agents
    from actors.episode import ModelPolicy
    from actors.weights import WeightGate

    react = import_named(str(AGENT)).react
    counting = CountingEngine(engine)
    client = AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="bench", max_retries=0)  # one, as the actor's
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
    actor = cfg.actor

    async def agent(task, base_url, key):
        if lean:
            return await lean_agent(http, task, base_url, actor)
        return await react(task, client.with_options(base_url=base_url), system=None, max_tokens=actor.max_tokens,
                           stop=actor.stop, max_turns=actor.max_turns)

    runner, rollouts = await serve_agents(cfg, counting, ModelPolicy(counting, WeightGate()), agent, {})

    async def one_loop(w: int) -> None:
        for i in range(rounds):
            await rollouts.run(w + loops * i, 0)

    try:
        started = time.perf_counter()
        await asyncio.gather(*[one_loop(w) for w in range(loops)])
        seconds = time.perf_counter() - started
    finally:
        await runner.cleanup()
        await client.close()
        await http.close()
    return {"tokens_per_s": counting.generated / seconds, "requests_per_s": counting.requests / seconds,
            "tokens": counting.generated, "requests": counting.requests, "seconds": seconds,
            "mean_prompt": counting.prompt_tokens / max(1, counting.requests)}


async def engine_alone(engine, requests: list[list[tuple[list[int], int]]]) -> dict:
    """Each loop's recorded requests sent again, one after the other, all loops at once."""

    async def one_loop(mine: list[tuple[list[int], int]]) -> int:
        tokens = 0
        for ids, max_tokens in mine:
            tokens += len((await engine.generate(ids, max_tokens)).token_ids)
        return tokens

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*[one_loop(mine) for mine in requests]))
    seconds = time.perf_counter() - started
    return _figures(tokens, [r for mine in requests for r in mine], seconds)


class Offline:
    """The offline baseline: `vllm.LLM` in a subprocess (two engines in one process do not
    mix well on CPU), started once; `measure` sends it a file of requests and reads back
    tokens and seconds of one `llm.generate`."""

    def __init__(self, model, actor, path: str, seed: int, tmp: str):
        self.tmp, self.log_path = tmp, os.path.join(tmp, "offline.log")
        cfg = json.dumps({"model": model.model_dump(), "actor": actor.model_dump(), "path": path, "seed": seed})
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.engine", "--offline", cfg],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.scheduler: dict | None = None

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        self.proc.wait(30)
        tail = Path(self.log_path).read_text()[-3000:]
        raise RuntimeError(f"the offline vLLM process exited (code {self.proc.returncode}); its log ends:\n{tail}")

    def wait_ready(self) -> dict:
        if self.scheduler is None:
            self.scheduler = self._answer()
        return self.scheduler

    def measure(self, requests: list[tuple[list[int], int]], params: dict) -> dict:
        path = os.path.join(self.tmp, "requests.json")
        Path(path).write_text(json.dumps({"params": params, "requests": requests}))
        self.proc.stdin.write(path + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        return _figures(answer["tokens"], requests, answer["seconds"])

    def end_input(self) -> None:
        """EOF: it shuts its engine down and exits."""
        if not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # it has exited already: close() says why
                self.proc.stdin.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.end_input()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                self.proc.wait(30)
        self.log.close()


def serve_offline(cfg_json: str) -> None:
    """The offline baseline's process: build `vllm.LLM`, answer each requests file named on
    stdin with one `llm.generate` over all its prompts, in its order. Answers go to the real stdout;
    everything else printed (vLLM's logs) goes to stderr."""
    from actors.engine import engine_args, share_cpus
    from common.config import ActorConfig, ModelConfig

    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    cfg = json.loads(cfg_json)
    model, actor = ModelConfig(**cfg["model"]), ActorConfig(**cfg["actor"])
    share_cpus()  # as VLLMEngine does
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.usage.usage_lib import UsageContext

    kwargs = engine_args(model, actor, cfg["path"], cfg["seed"])
    # LLM's defaults for these differ from AsyncLLM's: take the async engine's
    scheduler = AsyncEngineArgs(**kwargs).create_engine_config(UsageContext.ENGINE_CONTEXT).scheduler_config
    limits = {"max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens}
    llm = LLM(**kwargs, **limits)
    answers.write(RESULT + json.dumps(limits) + "\n")
    for line in sys.stdin:
        job = json.loads(Path(line.strip()).read_text())
        base = {**job["params"], "output_kind": RequestOutputKind.FINAL_ONLY}
        prompts = [{"prompt_token_ids": ids} for ids, _ in job["requests"]]
        params = [SamplingParams(max_tokens=max_tokens, **base) for _, max_tokens in job["requests"]]
        llm.reset_prefix_cache()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        answers.write(RESULT + json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                                           "seconds": seconds}) + "\n")
    llm.llm_engine.engine_core.shutdown()


def _start_env_server(options: dict, log) -> tuple[subprocess.Popen, int]:
    from broker.embedded import free_port
    from common.cli import override

    port = free_port()
    cmd = [sys.executable, "-m", "envs", "--env", "letters", "--port", str(port), "--set", "run.log_level=WARNING"]
    if options:
        cmd += ["--set", override("env.options", options)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log), port


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


def run(quick: bool, device: str = "cpu") -> dict:
    """Both points (one in quick mode), each alternated `repeats` times after a warm-up."""
    points_cfg = QUICK_POINTS if quick else POINTS
    loops = QUICK_EPISODES if quick else EPISODES
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="omrl-bench-engine-") as tmp, contextlib.ExitStack() as stack:
        points, scheduler = _measure_all(tmp, stack, points_cfg, loops, repeats)
    rows = [row(f"{p['point']}: generated tokens/s, {LABELS[system]} / {LABELS[baseline]}",
                p["runs"][system], p["runs"][baseline])
            for p in points for system, baseline in PAIRS]
    return {"points": points, "rows": rows, "episodes": loops, "repeats": repeats, "scheduler": scheduler,
            "device_note": "vLLM picks its platform itself (a GPU build takes the GPU); device is recorded only"}


def _measure_all(tmp: str, stack: contextlib.ExitStack, points_cfg: dict, loops: int, repeats: int):
    """Start the env servers, the offline process and the engine (at once: each takes a
    while), then measure every point. `stack` stops them all, in reverse order."""
    from actors.engine import VLLMEngine
    from common.config import ActorConfig, ModelConfig
    from common.models import init_tiny_model

    path = str(init_tiny_model(Path(tmp) / "model"))
    model, base = ModelConfig(path=path), ActorConfig()
    log = stack.enter_context(open(os.path.join(tmp, "env.log"), "w"))
    servers = {}
    for name, p in points_cfg.items():
        servers[name] = _start_env_server(p["env"], log)
        stack.callback(_stop, servers[name][0])
    offline = Offline(model, base, path, base.seed, tmp)
    stack.callback(offline.close)
    loop = asyncio.new_event_loop()  # one loop for everything: AsyncLLM is bound to it
    stack.callback(loop.close)

    async def start():
        return VLLMEngine(model, base, path, seed=base.seed)

    async def stop(engine) -> None:
        engine.shutdown()
        await asyncio.sleep(0)  # its output handler takes its cancellation

    _import_vllm()
    engine = loop.run_until_complete(start())
    stack.callback(lambda: loop.run_until_complete(stop(engine)))
    stack.callback(offline.end_input)  # first: both engines then shut down at once (seconds each)
    scheduler = offline.wait_ready()
    config = engine.llm.vllm_config.scheduler_config
    mine = {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens}
    if mine != scheduler:
        print(f"engine: warning: the offline engine's scheduler limits {scheduler} are not the engine's {mine}",
              flush=True)
    for proc, port in servers.values():
        wait_http(port, proc, timeout=120.0)
    session = loop.run_until_complete(_session())
    stack.callback(lambda: loop.run_until_complete(session.close()))
    params = {k: v for k, v in engine.params.items() if k != "output_kind"}  # the offline side sets its own
    points = [_measure_point(name, p, base, servers[name][1], session, engine, offline, params, loops, repeats, loop)
              for name, p in points_cfg.items()]
    return points, scheduler


def _import_vllm() -> None:
    """Import vLLM first from a thread of its own. vLLM keeps the exception of an optional
    import that fails (`_torchcodec_import_exc` in vllm/multimodal/media/audio.py) and with
    it every frame of the stack that first imported vLLM: from VLLMEngine's constructor,
    that keeps the engine alive to the end, where its `__del__` fails. A thread's stack
    holds nothing of ours."""
    thread = threading.Thread(target=importlib.import_module, args=("vllm.v1.engine.async_llm",), name="import-vllm")
    thread.start()
    thread.join()


async def _session():
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))  # as the actor's


def _measure_point(name, p, base, port, session, engine, offline, params, loops, repeats, loop) -> dict:
    """A warm-up of each kind (discarded), then `repeats` alternations; both baselines replay
    the requests of the episode-loop run just before them."""
    from actors.episode import EpisodeSetup
    from actors.templates import make_template
    from common.config import Config, EnvConfig, ModelConfig
    from envs.client import EnvClient
    from envs.specs import spec_for

    actor = base.model_copy(update=p["actor"])
    env = EnvClient(f"http://127.0.0.1:{port}", session, 120.0, spec_for("letters"))
    setup = EpisodeSetup(env, engine.tokenizer, actor, make_template(actor.action_template), "letters")
    figures: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    recorded: list = []

    def episode() -> float:
        loop.run_until_complete(engine.llm.reset_prefix_cache())
        f, requests = loop.run_until_complete(episode_loop(setup, engine, loops, p["rounds"]))
        recorded[:] = requests
        figures["episode_loop"].append(f)
        return f["tokens_per_s"]

    def alone() -> float:
        loop.run_until_complete(engine.llm.reset_prefix_cache())
        figures["engine_alone"].append(loop.run_until_complete(engine_alone(engine, recorded)))
        return figures["engine_alone"][-1]["tokens_per_s"]

    def off() -> float:
        # Shortest prompts first: each prompt comes after the one it extends (the turn before),
        # so, as in the episode loop, that one's blocks can be in vLLM's prefix cache. In the
        # loops' order the 6th turns would run next to the 1st and recompute them.
        flat = sorted((r for mine in recorded for r in mine), key=lambda r: len(r[0]))
        figures["offline"].append(offline.measure(flat, params))
        return figures["offline"][-1]["tokens_per_s"]

    agent_cfg = Config(model=ModelConfig(path="tiny"), actor=actor,
                       env=EnvConfig(name="letters", url=f"http://127.0.0.1:{port}"))

    def through_endpoint(kind: str) -> Callable[[], float]:
        def measure() -> float:
            loop.run_until_complete(engine.llm.reset_prefix_cache())
            figures[kind].append(loop.run_until_complete(agent_loops(agent_cfg, engine, loops, p["rounds"],
                                                                     lean=kind == "endpoint")))
            return figures[kind][-1]["tokens_per_s"]
        return measure

    measures = {"episode_loop": episode, "engine_alone": alone, "offline": off, "agent": through_endpoint("agent"),
                "endpoint": through_endpoint("endpoint")}
    alternate(measures, 1)  # warm-up
    for kind in KINDS:
        figures[kind].clear()
    runs = alternate(measures, repeats)
    point = {"point": name, "max_tokens": actor.max_tokens, "max_turns": actor.max_turns, "env_options": p["env"],
             "episodes": loops, "rounds": p["rounds"], "runs": runs}
    for kind in KINDS:
        point[kind] = {key: spread([f[key] for f in figures[kind]]) for key in FIGURES}
    for system, baseline in PAIRS:
        point[f"ratio_{system}_{baseline}"] = ratios(runs[system], runs[baseline])
    print(f"engine {name:<20} tokens/s: episode loop {point['episode_loop']['tokens_per_s']['median']:8.0f}  "
          f"engine alone {point['engine_alone']['tokens_per_s']['median']:8.0f}  "
          f"offline {point['offline']['tokens_per_s']['median']:8.0f}  "
          f"agent {point['agent']['tokens_per_s']['median']:8.0f}  "
          f"endpoint {point['endpoint']['tokens_per_s']['median']:8.0f}", flush=True)
    return point


def plot(result: dict, path) -> None:
    plt = pyplot()
    points = result["points"]
    fig, ax = plt.subplots(figsize=(3 + 2.5 * len(points), 4))
    width = 0.16
    for i, kind in enumerate(KINDS):
        x = [j + (i - 2) * width for j in range(len(points))]
        med = [p[kind]["tokens_per_s"]["median"] for p in points]
        err = [[m - p[kind]["tokens_per_s"]["min"] for m, p in zip(med, points)],
               [p[kind]["tokens_per_s"]["max"] - m for m, p in zip(med, points)]]
        ax.bar(x, med, width, yerr=err, capsize=3, label=LABELS[kind])
    ax.set_xticks(range(len(points)), [f"{p['point']}\n({p['episodes']} concurrent episodes)" for p in points])
    ax.set_ylim(0, 1.35 * max(p[kind]["tokens_per_s"]["max"] for p in points for kind in KINDS))  # room for the legend
    ax.set_ylabel("generated tokens/s (median, range)")
    ax.set_title("episode loop vs engine alone vs vLLM offline vs an agent through the endpoint")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test of the figures' shape")
    parser.add_argument("--offline", metavar="CFG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offline:
        serve_offline(args.offline)
    else:
        print(json.dumps(run(args.quick)["rows"], indent=1))
