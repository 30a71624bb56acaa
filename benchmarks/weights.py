"""`omrl bench weights`: a weight version from the learner's model to every actor's vLLM
engine, by each transport, against the raw transport of Redis moving the same bytes; and
what an update costs generation, interrupting running requests against draining them.

Transports (the learner's choice, `weights.*`; an actor follows each version's record):
`blob` (safetensors bytes in Redis chunks of weights.chunk_mb), `dir` (one safetensors file
in a directory every process sees: here a temporary directory on the machine's disk) and
`broadcast` (tensors packed into buckets of weights.bucket_mb, sent once down a gloo chain of
the learner's side and every actor, staged by each actor as a file, then loaded like a blob).

System, per repetition and transport: the learner's side as learner/worker.py runs it
(blob, dir: `Trainer.save_weights()` then `WeightStore.publish`; broadcast:
`Trainer.hf_state()` packed by `common.weight_sync.pack`, handed to a `BroadcastSender`,
then `WeightStore.announce`), then each actor's receiver as actors/worker.py builds it
(`receive_weights` with a `BroadcastLink` and the `WeightGate` of actor.update_mode, around a
real `VLLMEngine`; woken by the announcement, or at the latest by its poll every
actor.weight_poll_s). Latency: from the start of serialisation to the moment the last
actor's gate opens on the new version, split along that actor's path into serialise,
publish, wake-up (publish done -> the actor reads the record and starts its fetch),
fetch (blob: GET of the chunks, file write and sha256; dir: sha256 of the shared file;
broadcast: waiting for the version to arrive down the chain and be staged), gate (the
update closing the gate: with actor.update_mode "interrupt", the default, pausing the
engine), load (the engine's reload from the file) and resume. The
clocks are one machine's, but wake-up can read a millisecond or two below 0: the actor may
hear the announcement before the learner's PUBLISH call has returned. Each model's actors
apply one version by each transport untimed first (an engine's first reload and the
broadcast's join and first group cost more, once a process); --quick skips that, so its
first figures include them.

Baseline, the same for every transport so their ratios compare: the safetensors bytes,
already serialised, SET by the learner's side and then GET by each actor process on its own
connection (the readers are the actor processes themselves, told by a list push, so the
baseline crosses the same process boundaries and runs on the same cores as the system).
Figures: MB/s = the blob's bytes / latency for every transport (the broadcast's buckets
hold the same tensors, within alignment), higher is better; and the latency in seconds,
lower is better. The MB/s ratio system / baseline is below 1 by what serialisation,
checksums, waking up, files and the engine's reload cost over moving the bytes once through
Redis, above 1 where a transport beats that (the seconds' ratio is its inverse).
The transports alternate with the baseline (blob, dir, broadcast, baseline, blob, ...) on
one set of actors per model, each version newer than the last.

Models: Qwen2 with the 128-symbol character tokenizer (`init_tiny_model`), float32, from the
tiny default to about 147M parameters (a 590 MB blob, over Redis's default 512 MiB value
limit). The benchmark's Redis takes values up to 2 GB (proto-max-bulk-len), so that the
baseline can SET the largest blob as one value; the blob transport writes chunks of
weights.chunk_mb (64 MB) whatever the limit, so it runs as on `omrl run`'s server (Redis's
default limit). 2 actors (1 with --quick), each a receiver process
(`python -m benchmarks.weights --receiver ...`) holding a VLLMEngine; they report each
applied version with an RPUSH that the driver BLPOPs.

Update modes, in one process on the tiny model (`python -m benchmarks.weights --update-modes`):
one VLLMEngine with `concurrency` ModelPolicy.act loops of `tokens`-token turns (no stop
strings, end-of-sequence ignored: every turn runs its length), each loop on a prompt of its
own of random letters that ends its turns at `context` tokens (2048 and 4096; the prompt
comes from the prefix cache turn after turn, as an episode's next turn would), and
`updates` updates of the model's own file through `WeightGate.apply` ->
`VLLMEngine.load_weights`, `spacing_s` of generation apart; interrupt (the gate pauses the
engine: running requests come back and continue on the new weights, their contexts computed
again), keep (the same pause, the requests kept with their KV: they go on where they were)
and drain (the baseline: new calls wait while running ones finish) alternate, on fresh
gates, the KV cache sized for every loop's longest context (kv_cache_mb, with a quarter
over: no preemption). Per update: the gate's update_s (from the update's start until
generation may go on: for drain that includes waiting for the running turns, which still
generate meanwhile, fewer and fewer) and blocked_s (seconds generate calls waited at the
gate, summed over calls: what the turns lost); and tokens/s over the whole run, from the
first turn to the end of the last (each loop finishes its turn after the last update).
Ratios repetition by repetition, interrupt / drain, keep / drain and keep / interrupt: below
1 for the seconds when the system holds generation back less (lower is better), above 1 for
tokens/s when it generates more.

`device="cuda"` is minimal: the learner's copy of the model moves to the GPU (so
serialisation includes the copy off it) and vLLM picks the GPU itself; one actor per GPU
(CUDA_VISIBLE_DEVICES), since two engines on one GPU each reserve most of its memory. The
broadcast is gloo over TCP on any device, as in the learner."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import alternate, pyplot, ratios, row, spread

# (hidden, layers, heads): head size 64 throughout, intermediate 2 x hidden (init_tiny_model).
MODELS = ((128, 2, 2), (512, 8, 8), (1024, 14, 16))
QUICK_MODELS = ((128, 2, 2),)
ACTORS, QUICK_ACTORS = 2, 1
REPEATS, QUICK_REPEATS = 3, 1
START_TIMEOUT_S = 600.0  # for the actors' engines to come up
STEP_TIMEOUT_S = 300.0  # for one version to reach every actor
# The time split of one system repetition, on the critical path (the last actor to apply).
SPLIT = ("serialise", "publish", "wake-up", "fetch", "gate", "load", "resume")
BASELINE_SPLIT = ("SET", "notify", "GET")
REDIS_ARGS = ["--proto-max-bulk-len", "2gb"]  # the baseline's one value of the largest blob
UPDATE_MODES = ("interrupt", "keep", "drain")  # the systems, then their baseline
# Each figure of a system against its baseline in the same run: both against drain, keep against interrupt.
MODE_PAIRS = (("interrupt", "drain"), ("keep", "drain"), ("keep", "interrupt"))
PROMPT = "U: Say e"


@dataclasses.dataclass(frozen=True)
class Updates:
    """The update-mode comparison's workload."""

    concurrency: int  # turns generating at once
    tokens: int  # tokens a turn
    updates: int  # updates per run
    spacing_s: float  # seconds of generation before each update (and after the last)


UPDATES, QUICK_UPDATES = Updates(16, 200, 5, 1.0), Updates(4, 32, 2, 0.3)
# Contexts in tokens at the end of a turn: a prompt of its own per turn loop (context - tokens), reused
# turn after turn (from the prefix cache, as an episode's next turn), then the turn's tokens.
CONTEXTS, QUICK_CONTEXTS = (2048, 4096), (64, 128)
KV_MARGIN = 1.25  # KV cache over what the turns in flight hold at their longest: no preemption
UPDATES_TIMEOUT_S = 1800.0  # for the whole update-mode process, engine start included


def _keys(run: str):
    from broker.keys import Keys

    return Keys(run=run)


def _bench_keys(run: str) -> dict[str, str]:
    """The driver's and receivers' own lists (not the project's), under the run's prefix."""
    prefix = _keys(run).prefix
    return {"ready": f"{prefix}:bench:ready", "reports": f"{prefix}:bench:reports", "cmd": f"{prefix}:bench:cmd:"}


def _pack(obj: Any) -> bytes:
    import msgpack

    return msgpack.packb(obj)


def _unpack(data: bytes) -> Any:
    import msgpack

    return msgpack.unpackb(data)


# ---- transports: the learner's side --------------------------------------------------------


class BlobTransport:
    """Safetensors bytes in Redis chunks (WeightStore.publish, as learner/bridge.py builds it)."""

    def __init__(self, client, run: str, tmp: str, directory: str | None = None):
        from broker.weights import STAGING, WeightStore
        from common.config import LearnerConfig, WeightsConfig

        self.store = WeightStore(client, _keys(run), keep=LearnerConfig().keep_versions,
                                 chunk_bytes=WeightsConfig().chunk_mb << 20, directory=directory)
        self.staged = os.path.join(directory or tmp, STAGING)

    def serialise(self, trainer, version: int) -> str:
        os.makedirs(os.path.dirname(self.staged), exist_ok=True)
        trainer.save_weights(self.staged)  # as learner/worker.py: a file, written as the weights are gathered
        return self.staged

    async def publish(self, version: int, staged: str) -> None:
        await self.store.publish(version, version, staged)

    def close(self) -> None:
        pass


class DirTransport(BlobTransport):
    """The same bytes as one file in a directory every process sees (weights.dir), one per run."""

    def __init__(self, client, run: str, tmp: str):
        self.directory = str(Path(tmp) / f"weights-dir-{run}")
        super().__init__(client, run, tmp, self.directory)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)  # the next model needs the page cache more


class BroadcastTransport:
    """Packed tensors over gloo from a BroadcastSender; only the record goes to Redis."""

    def __init__(self, client, run: str, tmp: str):
        from broker.weights import WeightStore
        from common.config import LearnerConfig, WeightsConfig
        from learner.broadcast import BroadcastSender

        cfg = WeightsConfig()
        self.store = WeightStore(client, _keys(run), keep=LearnerConfig().keep_versions)
        self.bucket_bytes = cfg.bucket_mb << 20
        self.sender = BroadcastSender("127.0.0.1", 0, cfg.timeout_s)

    def serialise(self, trainer, version: int):
        import torch

        return trainer.weights_packed(version, torch.float32, self.bucket_bytes, "cpu")  # as learner/worker.py

    async def publish(self, version: int, packed) -> None:
        await self.store.announce(self.sender.publish(packed, step=version))

    def close(self) -> None:
        self.sender.close()


TRANSPORTS = {"blob": BlobTransport, "dir": DirTransport, "broadcast": BroadcastTransport}


# ---- the actor's side: one receiver process ----------------------------------------------


async def _receiver(args: argparse.Namespace) -> None:
    """The actor's receiver (actors/worker.py's store, gate and link), timed around its calls;
    and the baseline's reader."""
    from actors.engine import VLLMEngine
    from actors.weights import BroadcastLink, WeightGate, receive_weights
    from broker.connection import connect
    from broker.weights import WeightStore
    from common.config import ActorConfig, ModelConfig, WeightsConfig

    lists = _bench_keys(args.run)
    started = time.time()
    actor = ActorConfig()
    engine = VLLMEngine(ModelConfig(path=args.model, dtype="float32"), actor, args.model, seed=args.index)
    # BLPOP, RPUSH, the baseline's GET, the receiver's own (as actors/worker.py)
    control, reports, raw, weights = connect(args.url), connect(args.url), connect(args.url), \
        connect(args.url)
    stop = asyncio.Event()
    spans: dict[str, tuple[float, float]] = {}  # of the update under way: fetch (or join), load

    async def report(record: dict) -> None:
        await reports.rpush(lists["reports"], _pack({"actor": args.index, **record}))

    class TimedStore(WeightStore):
        async def fetch_to(self, record, directory):
            start = time.time()
            path = await super().fetch_to(record, directory)
            spans["fetch"] = (start, time.time())
            return path

    class TimedLink(BroadcastLink):
        async def receive(self, record):
            start = time.time()
            got = await super().receive(record)  # the wait for the staged version: relayed down the chain
            spans["fetch"] = (start, time.time())
            return got

    class TimedGate(WeightGate):
        async def apply(self, version, load):
            async def timed_load():
                start = time.time()
                loaded = await load()
                spans["load"] = (start, time.time())
                return loaded

            start = time.time()
            try:
                await super().apply(version, timed_load)
            except Exception as exc:
                await report({"kind": "failed", "version": version, "error": f"{type(exc).__name__}: {exc}"})
                raise
            await report({"kind": "applied", "version": self.version, "fetch": spans["fetch"],
                          "apply_start": start, "load": spans["load"], "applied": time.time()})

    store = TimedStore(weights, _keys(args.run))
    interrupt = actor.update_mode == "interrupt"
    gate = TimedGate(0, pause=engine.pause, resume=engine.resume) if interrupt else TimedGate(0)
    staging = tempfile.mkdtemp(prefix="omrl-bench-receiver-")
    link = TimedLink(f"bench-receiver-{args.index}", staging, WeightsConfig().timeout_s)

    async def commands() -> None:
        while not stop.is_set():
            reply = await control.blpop([f"{lists['cmd']}{args.index}"], timeout=1)
            if reply is None:
                continue
            cmd = _unpack(reply[1])
            get_start = time.time()
            blob = await raw.get(cmd["key"])
            await report({"kind": "raw", "key": cmd["key"], "get_start": get_start, "applied": time.time(),
                          "nbytes": len(blob)})
            del blob

    # SIGTERM (from the driver) stops both tasks, then the engine shuts down in order.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await reports.rpush(lists["ready"], _pack({"actor": args.index, "start_s": time.time() - started}))
        async with asyncio.TaskGroup() as tg:
            tg.create_task(receive_weights(store, gate, engine.load_weights, actor.weight_poll_s, stop, link=link))
            tg.create_task(commands())
    finally:
        link.close()
        for client in (control, reports, raw, weights):
            await client.aclose()
        engine.shutdown()
        shutil.rmtree(staging, ignore_errors=True)


# ---- update modes: one engine, generation under updates ------------------------------------


async def _update_run(engine, prompts: list[list[int]], weights: str, mode: str, shape: Updates) -> dict:
    """`shape.concurrency` turn loops, one per prompt, generating while `shape.updates` updates go
    through a fresh gate of `mode`; the gate's counters per update, and the run's token rate."""
    from actors.episode import ModelPolicy
    from actors.weights import update_gate

    gate = update_gate(mode, engine)
    policy = ModelPolicy(engine, gate)
    stop = asyncio.Event()
    tokens = 0

    async def turns(prompt: list[int]) -> None:
        nonlocal tokens
        while not stop.is_set():
            turn = await policy.act(prompt, shape.tokens, env_id=0)
            tokens += len(turn.generation.token_ids)

    started = time.monotonic()
    async with asyncio.TaskGroup() as tg:
        for prompt in prompts:
            tg.create_task(turns(prompt))
        for version in range(1, shape.updates + 1):
            await asyncio.sleep(shape.spacing_s)
            await gate.apply(version, lambda: engine.load_weights(weights))
        await asyncio.sleep(shape.spacing_s)
        stop.set()  # each loop ends after its turn: the run's tokens/s includes that tail
    seconds = time.monotonic() - started
    return {"mode": mode, "applied": gate.applied, "update_s": gate.update_s / gate.applied,
            "blocked_s": gate.blocked_s / gate.applied, "tokens_per_s": tokens / seconds, "tokens": tokens,
            "seconds": seconds, "busy": gate.generating_s / seconds}


def kv_cache_mb(model: str, concurrency: int, context: int) -> int:
    """MiB of KV cache that hold `concurrency` turns of `context` tokens, with KV_MARGIN: a key and
    a value per layer and key-value head, float32."""
    config = json.loads((Path(model) / "config.json").read_text())
    head = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head * 4
    return math.ceil(concurrency * context * per_token * KV_MARGIN / 2**20)


def _update_modes(args: argparse.Namespace) -> None:
    """The update modes in turn on one engine, `repeats` times per context; the result to
    args.result."""
    import random

    from actors.engine import VLLMEngine
    from common.config import ActorConfig, ModelConfig

    shape = QUICK_UPDATES if args.quick else UPDATES
    repeats = QUICK_REPEATS if args.quick else REPEATS
    contexts = QUICK_CONTEXTS if args.quick else CONTEXTS
    weights = str(Path(args.model) / "model.safetensors")
    kv_mb = kv_cache_mb(args.model, shape.concurrency, max(contexts))
    actor = ActorConfig(max_seq_len=max(contexts), kv_cache_mb=kv_mb)
    out = {"shape": dataclasses.asdict(shape), "kv_cache_mb": kv_mb, "contexts": []}
    with asyncio.Runner() as runner:
        async def start():
            engine = VLLMEngine(ModelConfig(path=args.model, dtype="float32"), actor, args.model, seed=0)
            engine.set_stop([])
            # The random model samples its end-of-sequence token about once in 128: ignored, so
            # every turn runs its length and drain waits for whole turns, as with long answers.
            engine.params["ignore_eos"] = True
            prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
            # Untimed: an engine's first reload, generate, pause and resume cost more, once a process.
            await engine.load_weights(weights)
            await engine.generate(prompt, 8)
            for keep in (False, True):
                await engine.pause(keep=keep)
                await engine.resume()
            return engine

        engine = runner.run(start())
        rng = random.Random(0)
        try:
            for context in contexts:
                letters = [engine.tokenizer.encode("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=context)),
                                                   add_special_tokens=False) for _ in range(shape.concurrency)]
                prompts = [ids[:context - shape.tokens] for ids in letters]  # a prompt of its own per loop
                runs: dict[str, list[dict]] = {mode: [] for mode in UPDATE_MODES}

                def measure(mode: str) -> float:
                    runs[mode].append(runner.run(_update_run(engine, prompts, weights, mode, shape)))
                    return runs[mode][-1]["update_s"]

                alternate({mode: lambda m=mode: measure(m) for mode in UPDATE_MODES}, repeats)
                out["contexts"].append({"context": context, "prompt": len(prompts[0]), "runs": runs})
                tokens_per_s = {m: spread([r["tokens_per_s"] for r in runs[m]])["median"] for m in UPDATE_MODES}
                print(f"update modes, context {context}: tokens/s " +
                      ", ".join(f"{m} {v:.0f}" for m, v in tokens_per_s.items()), flush=True)
        finally:
            engine.shutdown()
    Path(args.result).write_text(json.dumps(out))


def measure_update_modes(model: Model, quick: bool, device: str, log_dir: str) -> dict:
    """Run `_update_modes` in a process of its own (vLLM's engine core is a child of it: one
    process group, stopped whole) and return its result."""
    from deploy.supervisor import Process

    result = Path(log_dir) / "update-modes.json"
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = "0"
    cmd = [sys.executable, "-m", "benchmarks.weights", "--update-modes", "--model", model.path,
           "--result", str(result), *(["--quick"] if quick else [])]
    proc = Process("update modes", cmd, Path(log_dir) / "update-modes.log", env=env)
    proc.start()
    try:
        deadline = time.monotonic() + UPDATES_TIMEOUT_S
        while proc.alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the update-mode run took over {UPDATES_TIMEOUT_S:.0f}s:\n{proc.tail(30)}")
            time.sleep(0.5)
    finally:
        proc.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"the update-mode run exited with {proc.returncode}:\n{proc.tail(30)}")
    out = json.loads(result.read_text())
    out.update(model=model.label, params=model.params)
    return out


# ---- the learner's side: the driver --------------------------------------------------------


@dataclasses.dataclass
class Model:
    hidden: int
    layers: int
    heads: int
    path: str
    params: int = 0
    nbytes: int = 0

    @property
    def label(self) -> str:
        return f"{self.params / 1e6:.1f}M"


class Receivers:
    """The actor processes of one model, each in a process group of its own (`Process` of
    the supervisor: a stop is SIGTERM, which shuts the receiver's engine down, then SIGKILL
    to what is left of its group)."""

    def __init__(self, url: str, run: str, model: Model, actors: int, device: str, log_dir: str):
        from deploy.supervisor import Process

        self.procs: list[Process] = []
        try:
            for i in range(actors):
                env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
                if device == "cuda":
                    env["CUDA_VISIBLE_DEVICES"] = str(i)
                cmd = [sys.executable, "-m", "benchmarks.weights", "--receiver", "--url", url, "--run", run,
                       "--model", model.path, "--index", str(i)]
                self.procs.append(Process(f"weights receiver {i}", cmd, Path(log_dir) / f"receiver-{run}-{i}.log",
                                          env=env))
                self.procs[-1].start()
        except BaseException:
            self.stop()  # the ones that did start
            raise

    def check(self) -> None:
        for p in self.procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} (pid {p.proc.pid}) exited with {p.returncode}:\n{p.tail(30)}")

    def tails(self, lines: int = 15) -> str:
        return "\n".join(f"--- {p.name}:\n{p.tail(lines)}" for p in self.procs)

    def peak_rss_mb(self) -> list[float]:
        """VmHWM of each receiver and its engine processes, summed per receiver."""
        import psutil

        peaks = []
        for p in self.procs:
            total = 0
            for proc in [psutil.Process(p.proc.pid), *psutil.Process(p.proc.pid).children(recursive=True)]:
                with open(f"/proc/{proc.pid}/status") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
            peaks.append(total / 1024)
        return peaks

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to every receiver at once, then each stopped in turn (SIGKILL past `timeout`)."""
        for p in self.procs:
            p.signal(signal.SIGTERM)
        for p in self.procs:
            p.stop(timeout)


async def _collect(client, key: str, n: int, receivers: Receivers, timeout: float) -> list[dict]:
    """n records from the list `key`, failing if a receiver dies or time runs out."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n:
        receivers.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(got)} of {n} receivers reported within {timeout:.0f}s:\n{receivers.tails()}")
        reply = await client.blpop([key], timeout=1)
        if reply is not None:
            got.append(_unpack(reply[1]))
    return got


def build_model(root: str, hidden: int, layers: int, heads: int) -> Model:
    from safetensors import safe_open

    from common.models import init_tiny_model

    path = init_tiny_model(Path(root) / f"qwen2-h{hidden}-l{layers}", hidden=hidden, layers=layers, heads=heads)
    params = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                count = 1
                for dim in f.get_slice(name).get_shape():
                    count *= dim
                params += count
    return Model(hidden, layers, heads, str(path), params)


def measure_model(runner: asyncio.Runner, url: str, model: Model, actors: int, repeats: int, warmup: bool,
                  device: str, log_dir: str) -> list[dict]:
    """Start the actors on `model`, apply one version by each transport untimed (warmup), then
    alternate the transports and the baseline `repeats` times: one point per transport."""
    import hashlib

    from broker.connection import connect
    from common.config import LearnerConfig
    from common.models import load_causal_lm
    from learner.trainer import Trainer

    run = f"w{uuid.uuid4().hex[:8]}"
    lists = _bench_keys(run)
    client = connect(url)  # as learner/bridge.py; used on the runner's loop only
    trainer = Trainer(load_causal_lm(model.path).to(device), LearnerConfig())
    sized = os.path.join(log_dir, "version.safetensors")
    trainer.save_weights(sized)
    blob = Path(sized).read_bytes()  # the baseline's one value: the same bytes
    os.unlink(sized)
    model.nbytes = len(blob)
    transports: dict[str, Any] = {}
    receivers = None
    system_runs: dict[str, list[dict]] = {name: [] for name in TRANSPORTS}
    baseline_runs: list[dict] = []
    version = 0

    async def system(name: str) -> float:
        nonlocal version
        version += 1
        transport = transports[name]
        t0 = time.time()
        out = transport.serialise(trainer, version)
        t1 = time.time()
        await transport.publish(version, out)
        t2 = time.time()
        del out
        reports = await _collect(client, lists["reports"], actors, receivers, STEP_TIMEOUT_S)
        assert all(r["kind"] == "applied" and r["version"] == version for r in reports), reports
        last = max(reports, key=lambda r: r["applied"])
        (fetch_start, fetch_end), (load_start, load_end) = last["fetch"], last["load"]
        latency = last["applied"] - t0
        system_runs[name].append({"seconds": latency, "split": dict(zip(SPLIT, (
            t1 - t0, t2 - t1, fetch_start - t2, fetch_end - fetch_start, load_start - fetch_end,
            load_end - load_start, last["applied"] - load_end)))})
        return model.nbytes / latency / 1e6

    async def baseline() -> float:
        key = f"{_keys(run).prefix}:bench:raw:{len(baseline_runs)}"
        t0 = time.time()
        await client.set(key, blob)
        t1 = time.time()
        for i in range(actors):
            await client.rpush(f"{lists['cmd']}{i}", _pack({"op": "raw", "key": key}))
        reports = await _collect(client, lists["reports"], actors, receivers, STEP_TIMEOUT_S)
        assert all(r["kind"] == "raw" and r["nbytes"] == len(blob) for r in reports), reports
        await client.delete(key)
        last = max(reports, key=lambda r: r["applied"])
        latency = last["applied"] - t0
        baseline_runs.append({"seconds": latency, "split": dict(zip(BASELINE_SPLIT, (
            t1 - t0, last["get_start"] - t1, last["applied"] - last["get_start"])))})
        return len(blob) / latency / 1e6

    try:
        for name, cls in TRANSPORTS.items():
            transports[name] = cls(client, run, log_dir)
        receivers = Receivers(url, run, model, actors, device, log_dir)
        ready = runner.run(_collect(client, lists["ready"], actors, receivers, START_TIMEOUT_S))
        first_apply = {}
        if warmup:
            for name in TRANSPORTS:
                runner.run(system(name))
                first_apply[name] = system_runs[name].pop()
        measures = {name: (lambda n=name: runner.run(system(n))) for name in TRANSPORTS}
        runs = alternate({**measures, "baseline": lambda: runner.run(baseline())}, repeats)
        started = time.perf_counter()
        hashlib.sha256(blob).hexdigest()
        checksum_s = time.perf_counter() - started  # what publish and fetch spend on it (blob, dir)
        peak_rss = receivers.peak_rss_mb()
        redis_peak = int(runner.run(client.info("memory"))["used_memory_peak"])
        sender = transports["broadcast"].sender
        sender.settled(STEP_TIMEOUT_S)  # the actors applied the last version before the sender read their word
        sent = sender.sent
    finally:
        if receivers is not None:
            receivers.stop()
        for transport in transports.values():
            transport.close()
        runner.run(_forget(client, run))
        runner.run(client.aclose())
    common = {
        "model": model.label, "hidden": model.hidden, "layers": model.layers, "heads": model.heads,
        "params": model.params, "bytes": model.nbytes, "actors": actors,
        "engine_start_s": sorted(r["start_s"] for r in ready), "checksum_s": checksum_s,
        "baseline": spread(runs["baseline"]), "baseline_mb_s": runs["baseline"],
        "baseline_s": spread([r["seconds"] for r in baseline_runs]),
        "baseline_split": _median_run(baseline_runs)["split"], "baseline_runs": baseline_runs,
        "receiver_peak_rss_mb": peak_rss, "redis_peak_mb": redis_peak / 1e6, "broadcast_sent": sent,
    }
    return [{**common, "transport": name, "system": spread(runs[name]),
             "ratio": ratios(runs[name], runs["baseline"]), "system_mb_s": runs[name],
             "system_s": spread([r["seconds"] for r in system_runs[name]]),
             "split": _median_run(system_runs[name])["split"], "first_apply": first_apply.get(name),
             "system_runs": system_runs[name]} for name in TRANSPORTS]


async def _forget(client, run: str) -> None:
    """Delete the run's keys (the kept versions' chunks among them): the next model's run needs
    the memory more."""
    async for key in client.scan_iter(match=f"{_keys(run).prefix}:*", count=1000):
        await client.delete(key)


def _median_run(runs: list[dict]) -> dict:
    """The repetition of median latency (the lower one of an even count): its parts add up to it."""
    return sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]


def run(quick: bool, device: str = "cpu") -> dict:
    import torch

    from broker.embedded import EmbeddedRedis, find_redis_server

    actors = QUICK_ACTORS if quick else ACTORS
    if device == "cuda":
        actors = min(actors, torch.cuda.device_count())
    repeats = QUICK_REPEATS if quick else REPEATS
    points = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="omrl-bench-weights-") as tmp, \
            EmbeddedRedis(binary=find_redis_server("bundled"), extra_args=REDIS_ARGS) as server, \
            asyncio.Runner() as runner:
        memory = measure_publish_memory(build_model(tmp, *(QUICK_MODELS if quick else MODELS)[-1]), repeats)
        print(f"weights: MB added while packing a version, gathered {memory['runs']['gathered'][0]['extra_mb']:.0f}, "
              f"whole state first {memory['runs']['whole'][0]['extra_mb']:.0f} "
              f"(payload {memory['runs']['gathered'][0]['payload_mb']:.0f})", flush=True)
        updates = measure_update_modes(build_model(tmp, *QUICK_MODELS[0]), quick, device, tmp)
        for at in updates["contexts"]:
            medians = {mode: spread([r["update_s"] for r in at["runs"][mode]])["median"] for mode in UPDATE_MODES}
            print(f"weights: s held back per update at {at['context']} tokens of context, "
                  + ", ".join(f"{mode} {medians[mode]:.3f}" for mode in UPDATE_MODES)
                  + f" ({time.monotonic() - started:.0f} s)", flush=True)
        for shape in QUICK_MODELS if quick else MODELS:
            model = build_model(tmp, *shape)
            for point in measure_model(runner, server.url, model, actors, repeats, not quick, device, tmp):
                points.append(point)
                print(f"weights {point['model']:>7} ({point['bytes'] / 1e6:7.1f} MB) {point['transport']:>9}: "
                      f"s {point['system_s']['median']:7.3f} (raw {point['baseline_s']['median']:7.3f}), MB/s "
                      f"{point['system']['median']:8.1f} (raw {point['baseline']['median']:8.1f})  "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
            for f in Path(model.path).glob("*.safetensors"):
                f.unlink()  # the next model's engines need the page cache more
    return {"points": points, "updates": updates, "publish_memory": memory, "redis_args": REDIS_ARGS,
            "rows": _rows(points, updates, memory)}


def _rows(points: list[dict], updates: dict, memory: dict) -> list[dict]:
    """Per model and transport: MB/s and seconds publish -> applied against SET + GET; then the
    update modes' rows (interrupt against drain), and the learner's memory while packing a
    version. Each row names its transport or figure."""
    rows = []
    for p in points:
        where = f"{p['model']} params ({p['bytes'] / 1e6:.1f} MB), {p['transport']}"
        rows.append({**row(f"{where}: MB/s publish -> applied in {p['actors']} actors (baseline: Redis SET + GET)",
                           p["system_mb_s"], p["baseline_mb_s"]), "transport": p["transport"], "figure": "MB/s"})
        rows.append({**row(f"{where}: s publish -> applied in {p['actors']} actors (baseline: Redis SET + GET; "
                           "lower is better)", [r["seconds"] for r in p["system_runs"]],
                           [r["seconds"] for r in p["baseline_runs"]]), "transport": p["transport"], "figure": "s"})
    rows += _update_rows(updates)
    gathered, whole, file = (memory["runs"][k] for k in ("gathered", "whole", "file"))
    rows.append({**row(f"{memory['model']} params: MB the learner adds while packing a version in bf16 "
                       f"({gathered[0]['payload_mb']:.0f} MB; broadcast), gathered a tensor at a time vs the whole "
                       "fp32 state first (lower is better)", [r["extra_mb"] for r in gathered],
                       [r["extra_mb"] for r in whole]), "figure": "publish_mb"})
    rows.append({**row(f"{memory['model']} params: MB the learner adds while writing a version's file in bf16 "
                       f"({file[0]['payload_mb']:.0f} MB; blob, dir), a tensor at a time as gathered vs packing "
                       "from the whole fp32 state first (lower is better)", [r["extra_mb"] for r in file],
                       [r["extra_mb"] for r in whole]), "figure": "publish_file_mb"})
    return rows


def _update_rows(updates: dict) -> list[dict]:
    """Per context, each update-mode figure of each pair in MODE_PAIRS (system vs baseline)."""
    shape, rows = updates["shape"], []
    for at in updates["contexts"]:
        runs = at["runs"]
        workload = (f"{updates['model']} params, {shape['concurrency']} turns of {shape['tokens']} tokens at "
                    f"{at['context']} tokens of context, {shape['updates']} updates")
        for figure, what in (("tokens_per_s", "tokens/s while updating"),
                             ("update_s", "s generation held back per update"),
                             ("blocked_s", "s generate calls waited at the gate per update, summed over calls")):
            better = "higher" if figure == "tokens_per_s" else "lower"
            for system, baseline in MODE_PAIRS:
                rows.append({**row(f"{what}, {system} vs {baseline} ({workload}; {better} is better)",
                                   [r[figure] for r in runs[system]], [r[figure] for r in runs[baseline]]),
                             "figure": figure, "modes": [system, baseline], "context": at["context"]})
    return rows


def plot(result: dict, path) -> None:
    plt = pyplot()
    points = result["points"]
    fig, (rate, split, modes) = plt.subplots(1, 3, figsize=(18, 5), gridspec_kw={"width_ratios": [1.1, 1.3, 0.8]})
    for transport in dict.fromkeys(p["transport"] for p in points):
        ps = [p for p in points if p["transport"] == transport]
        _errorbar(rate, [p["bytes"] / 1e6 for p in ps], [p["system"] for p in ps], "-o",
                  f"{transport}: publish -> applied")
    if points:
        ps = [p for p in points if p["transport"] == points[0]["transport"]]  # one baseline per model
        _errorbar(rate, [p["bytes"] / 1e6 for p in ps], [p["baseline"] for p in ps], "--x", "raw: Redis SET + GET")
    rate.set_xscale("log")
    rate.set_yscale("log")
    rate.set_xlabel("blob (MB)")
    rate.set_ylabel("MB/s (higher is better)")
    rate.set_title(f"weights to {points[0]['actors'] if points else 0} actors")
    rate.grid(alpha=0.3, which="both")
    rate.legend(fontsize=8)
    labels = [f"{p['model']}\n{p['transport']}" for p in points]
    left = [0.0] * len(points)
    for part in SPLIT:
        share = [max(0.0, p["split"][part]) / sum(max(0.0, v) for v in p["split"].values()) for p in points]
        split.barh(labels, share, left=left, label=part)
        left = [a + b for a, b in zip(left, share)]
    for i, p in enumerate(points):
        split.text(1.01, i, f"{sum(p['split'].values()):.3g} s\n(raw {sum(p['baseline_split'].values()):.3g} s)",
                   va="center", fontsize=8)
    split.set_xlim(0, 1.45)
    split.set_xlabel("share of publish -> applied, last actor (median repetition)")
    split.set_title("where the time goes")
    split.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4)
    updates = result["updates"]
    contexts = updates["contexts"]
    width = 0.8 / len(UPDATE_MODES)
    for j, mode in enumerate(UPDATE_MODES):
        xs = [i + (j - (len(UPDATE_MODES) - 1) / 2) * width for i in range(len(contexts))]
        stats = [spread([r["tokens_per_s"] for r in at["runs"][mode]]) for at in contexts]
        held = [spread([r["update_s"] for r in at["runs"][mode]])["median"] for at in contexts]
        modes.bar(xs, [s["median"] for s in stats], width,
                  yerr=[[s["median"] - s["min"] for s in stats], [s["max"] - s["median"] for s in stats]],
                  capsize=3, label=f"{mode} (s held back per update: " + ", ".join(f"{h:.2f}" for h in held) + ")")
    modes.set_xticks(range(len(contexts)), [f"{at['context']} tokens" for at in contexts])
    modes.set_xlabel("context")
    modes.set_ylabel("tokens/s while updating (higher is better)")
    modes.set_title(f"update modes: {updates['shape']['concurrency']} turns of {updates['shape']['tokens']} tokens")
    modes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _errorbar(ax, x: list[float], stats: list[dict], style: str, label: str) -> None:
    med = [s["median"] for s in stats]
    err = [[m - s["min"] for m, s in zip(med, stats)], [s["max"] - m for m, s in zip(med, stats)]]
    ax.errorbar(x, med, yerr=err, fmt=style, capsize=3, label=label)


def _publish_memory(args: argparse.Namespace) -> None:
    """One packing of a version for the broadcast transport in this process, in bf16 with the
    default bucket size: the peak resident memory it added, as JSON on stdout. `gathered`: the
    learner's path (`Trainer.weights_packed`: a tensor at a time, packed as gathered); `whole`:
    the path before it, the whole fp32 state gathered first (a full state dict), cast, then
    packed; `file`: the blob transport's (`Trainer.save_weights`: each tensor written to the
    version's file as it is gathered)."""
    import torch

    from benchmarks.learner import PeakRss
    from common.config import LearnerConfig, WeightsConfig
    from common.models import load_causal_lm
    from common.weight_sync import pack
    from learner.trainer import PREFIX, Trainer

    bucket = WeightsConfig().bucket_mb << 20
    trainer = Trainer(load_causal_lm(args.model), LearnerConfig(device="cpu"))
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.0)  # resident, as after training steps (the loaded file is mapped, not yet read)
    with PeakRss() as peak:
        if args.publish_memory == "gathered":
            packed = trainer.weights_packed(1, torch.bfloat16, bucket, "cpu")
        elif args.publish_memory == "file":
            path = Path(args.model) / "publish-memory.safetensors"
            packed = argparse.Namespace(nbytes=trainer.save_weights(path, torch.bfloat16))  # as learner/worker.py
            path.unlink()
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(trainer.scorer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            tied = PREFIX + "lm_head.weight" if trainer.model.config.tie_word_embeddings else None
            policy = {k[len(PREFIX):]: v.to(torch.bfloat16) for k, v in state.items() if k.startswith(PREFIX) and k != tied}
            del state
            packed = pack(1, policy.items(), bucket, "cpu")
    print(json.dumps({"extra_mb": peak.increase / 1e6, "payload_mb": packed.nbytes / 1e6}))


def measure_publish_memory(model: Model, repeats: int) -> dict:
    """The learner's extra host memory while packing a version, gathered against whole-state-first,
    each packing in a fresh process (a process's freed heap would hide the second one's peak)."""
    def once(kind: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "benchmarks.weights", "--publish-memory", kind, "--model",
                               model.path], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"publish memory ({kind}) failed:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    runs = alternate({kind: (lambda k=kind: once(k)) for kind in ("gathered", "whole", "file")}, repeats)
    return {"model": model.label, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="weights benchmark; --receiver, --update-modes: its processes "
                                                 "(internal)")
    parser.add_argument("--receiver", action="store_true", help="run one receiver for the driver in run()")
    parser.add_argument("--update-modes", action="store_true", help="run the update-mode comparison")
    parser.add_argument("--publish-memory", choices=("gathered", "whole", "file"),
                        help="measure one packing (internal)")
    parser.add_argument("--url", help="Redis URL")
    parser.add_argument("--run", help="run name: the keys' prefix")
    parser.add_argument("--model", help="model directory")
    parser.add_argument("--index", type=int, default=0, help="actor index")
    parser.add_argument("--result", help="--update-modes: the JSON file it writes")
    parser.add_argument("--quick", action="store_true", help="the quick run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="without --receiver: where the learner's copy of the model sits")
    args = parser.parse_args(argv)
    from common.logs import setup_logging

    if args.publish_memory:
        _publish_memory(args)
    elif args.receiver:
        setup_logging(f"weights-receiver{args.index}", "INFO")
        asyncio.run(_receiver(args))
    elif args.update_modes:
        setup_logging("weights-update-modes", "INFO")
        _update_modes(args)
    else:
        setup_logging("weights", "INFO", stream=sys.stderr)
        print(json.dumps(run(args.quick, args.device)["rows"], indent=1))


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is needed
    main()
