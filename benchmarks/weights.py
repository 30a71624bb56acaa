"""`omrl bench weights`: a weight version from the learner's model to every actor's vLLM
engine, per transport, against the raw transport moving the same bytes.

System, per repetition: the learner's serialisation (`Trainer.weights_blob()`, safetensors
bytes of the state dict), `WeightStore.publish` (SET of the blob + the version record, one
transaction), then each actor's receiver as the actor runs it (`receive_weights` from
actors/weights.py: woken by the version's announcement, or at the latest by its poll every
actor.weight_poll_s, it fetches and verifies the blob, writes it to a file and has the
engine reload it in place through `VLLMEngine.load_weights`). Latency: from the start of
serialisation to the moment the last actor's engine has the weights, split along that
actor's path into serialise, publish, wake-up (publish done -> its fetch starts),
fetch+verify (GET + sha256), write file and engine reload (`collective_rpc` ->
`reload_weights`). Each model's actors apply
one version untimed first (an engine's first reload costs more, once a process).

Baseline: the same bytes, already serialised, SET by the learner's side and then GET by
each actor process on its own connection (the readers are the actor processes themselves,
told by a list push, so the baseline crosses the same process boundaries and runs on the
same cores as the system; only what the project adds differs). Both figures are MB/s =
blob bytes / latency; the ratio system / baseline is below 1 by what serialisation, the checksum, waking up, the file and the engine's reload
cost over moving the bytes (1.0: the project adds nothing to Redis).

Models: Qwen2 with the 128-symbol character tokenizer (`init_tiny_model`), float32, from the
tiny default up to about 126M parameters (a 504 MB blob). That is the largest the blob
transport carries with Redis as the project starts it: Redis refuses a bulk value over
`proto-max-bulk-len` (512 MiB by default, not raised by broker/embedded.py), so
`WeightStore.publish` refuses a larger blob (`WeightsTooLarge`; chunked blobs are issue
10's). The full run checks this against the server it starts and reports it under
"blob_limit". 2 actors (1 with --quick),
each a receiver process (`python -m benchmarks.weights --receiver ...`) holding a
VLLMEngine; they report each applied version with an RPUSH that the driver BLPOPs.

Transports: `blob` (Redis) today. The torch.distributed broadcast (issue 10) is to come:
one more entry in TRANSPORTS, with its raw baseline a broadcast of the same tensors.
`device="cuda"` is minimal: the learner's copy of the model moves to the GPU (so
serialisation includes the copy off it) and vLLM picks the GPU itself; one actor per GPU
(CUDA_VISIBLE_DEVICES), since two engines on one GPU each reserve most of its memory."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from benchmarks.common import alternate, pyplot, ratios, row, spread

# (hidden, layers, heads): head size 64 throughout, intermediate 2 x hidden (init_tiny_model).
MODELS = ((128, 2, 2), (512, 8, 8), (1024, 12, 16))
QUICK_MODELS = ((128, 2, 2),)
ACTORS, QUICK_ACTORS = 2, 1
REPEATS, QUICK_REPEATS = 3, 1
START_TIMEOUT_S = 600.0  # for the actors' engines to come up
STEP_TIMEOUT_S = 300.0  # for one version to reach every actor
# The time split of one system repetition, on the critical path (the last actor to apply).
SPLIT = ("serialise", "publish", "wake-up", "fetch+verify", "write file", "engine reload")
BASELINE_SPLIT = ("SET", "notify", "GET")


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


# ---- transports ------------------------------------------------------------------------


class BlobTransport:
    """Safetensors bytes in Redis (broker/weights.py, actors/weights.py); its raw baseline
    is a SET of the same bytes, then a GET by each actor."""

    def __init__(self, client, run: str):
        from broker.weights import WeightStore
        from common.config import LearnerConfig

        self.client, self.run = client, run
        self.store = WeightStore(client, _keys(run), keep=LearnerConfig().keep_versions)  # as learner/bridge.py

    async def publish(self, version: int, blob: bytes) -> None:
        """System, learner's side."""
        await self.store.publish(version, version, blob)

    async def raw_send(self, key: str, blob: bytes) -> None:
        """Baseline, learner's side: the bytes where the readers can take them."""
        await self.client.set(key, blob)

    async def raw_done(self, key: str) -> None:
        await self.client.delete(key)

    @staticmethod
    async def receive(url: str, run: str, engine, report: Callable[[dict], Awaitable[None]],
                      stop: asyncio.Event) -> None:
        """System, actor's side: the actor's receiver, timed around its calls."""
        from actors.weights import WeightGate, receive_weights
        from broker.connection import connect
        from broker.weights import WeightStore
        from common.config import ActorConfig

        class TimedStore(WeightStore):
            last: tuple[int, float, float] = (0, 0.0, 0.0)  # version, fetch start, fetch end

            async def fetch(self, record):
                started = time.time()
                blob = await super().fetch(record)
                self.last = (record["version"], started, time.time())
                return blob

        client = connect(url)  # as actors/worker.py
        store = TimedStore(client, _keys(run))

        async def load(path: str) -> None:
            version, fetch_start, fetch_end = store.last  # apply_newest loads what it fetched last
            load_start = time.time()
            await engine.load_weights(path)
            applied = time.time()
            await report({"kind": "applied", "version": version, "fetch_start": fetch_start, "fetch_end": fetch_end,
                          "load_start": load_start, "applied": applied})

        try:
            await receive_weights(store, WeightGate(version=0), load, ActorConfig().weight_poll_s, stop)
        finally:
            await client.aclose()

    @staticmethod
    async def raw_receive(client, key: str) -> int:
        """Baseline, actor's side: the bytes; their size."""
        blob = await client.get(key)
        return len(blob)


TRANSPORTS = {"blob": BlobTransport}


# ---- the actor's side: one receiver process ----------------------------------------------


async def _receiver(args: argparse.Namespace) -> None:
    from actors.engine import VLLMEngine
    from broker.connection import connect
    from common.config import ActorConfig, ModelConfig

    transport = TRANSPORTS[args.transport]
    lists = _bench_keys(args.run)
    started = time.time()
    engine = VLLMEngine(ModelConfig(path=args.model, dtype="float32"), ActorConfig(), args.model, seed=args.index)
    control, reports, raw = connect(args.url, blocking=True), connect(args.url), connect(args.url)  # BLPOP, RPUSH, GET
    stop = asyncio.Event()

    async def report(record: dict) -> None:
        await reports.rpush(lists["reports"], _pack({"actor": args.index, **record}))

    async def commands() -> None:
        while not stop.is_set():
            reply = await control.blpop([f"{lists['cmd']}{args.index}"], timeout=1)
            if reply is None:
                continue
            cmd = _unpack(reply[1])
            get_start = time.time()
            nbytes = await transport.raw_receive(raw, cmd["key"])
            await report({"kind": "raw", "key": cmd["key"], "get_start": get_start, "applied": time.time(),
                          "nbytes": nbytes})

    # SIGTERM (from the driver) stops both tasks, then the engine shuts down in order.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await reports.rpush(lists["ready"], _pack({"actor": args.index, "start_s": time.time() - started}))
        async with asyncio.TaskGroup() as tg:
            tg.create_task(transport.receive(args.url, args.run, engine, report, stop))
            tg.create_task(commands())
    finally:
        for client in (control, reports, raw):
            await client.aclose()
        engine.shutdown()


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

    def __init__(self, url: str, run: str, model: Model, transport: str, actors: int, device: str, log_dir: str):
        from deploy.supervisor import Process

        self.procs: list[Process] = []
        try:
            for i in range(actors):
                env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
                if device == "cuda":
                    env["CUDA_VISIBLE_DEVICES"] = str(i)
                cmd = [sys.executable, "-m", "benchmarks.weights", "--receiver", "--url", url, "--run", run,
                       "--model", model.path, "--index", str(i), "--transport", transport]
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
            raise TimeoutError(f"{len(got)} of {n} receivers reported within {timeout:.0f}s")
        reply = await client.blpop([key], timeout=1)
        if reply is not None:
            got.append(_unpack(reply[1]))
    return got


def build_model(root: str, hidden: int, layers: int, heads: int) -> Model:
    from common.models import init_tiny_model

    path = init_tiny_model(Path(root) / f"qwen2-h{hidden}-l{layers}", hidden=hidden, layers=layers, heads=heads)
    return Model(hidden, layers, heads, str(path))


def measure_model(runner: asyncio.Runner, url: str, model: Model, transport_name: str, actors: int, repeats: int,
                  warmup: bool, device: str, log_dir: str) -> dict:
    """Start the actors on `model`, apply one version untimed (warmup: an engine's first
    reload costs more, once a process), then alternate system and baseline `repeats` times."""
    import hashlib

    from broker.connection import connect
    from common.config import LearnerConfig
    from common.models import load_causal_lm
    from learner.trainer import Trainer

    run = f"w{uuid.uuid4().hex[:8]}"
    lists = _bench_keys(run)
    client = connect(url, blocking=True)  # as learner/bridge.py; used on the runner's loop only
    transport = TRANSPORTS[transport_name](client, run)
    trainer = Trainer(load_causal_lm(model.path).to(device), LearnerConfig())
    model.params = sum(p.numel() for p in trainer.model.parameters())
    blob = trainer.weights_blob()
    model.nbytes = len(blob)
    receivers = Receivers(url, run, model, transport_name, actors, device, log_dir)
    system_runs: list[dict] = []
    baseline_runs: list[dict] = []
    version = 0

    async def system() -> float:
        nonlocal version
        version += 1
        t0 = time.time()
        out = trainer.weights_blob()
        t1 = time.time()
        await transport.publish(version, out)
        t2 = time.time()
        reports = await _collect(client, lists["reports"], actors, receivers, STEP_TIMEOUT_S)
        assert all(r["kind"] == "applied" and r["version"] == version for r in reports), reports
        last = max(reports, key=lambda r: r["applied"])
        latency = last["applied"] - t0
        system_runs.append({"seconds": latency, "split": dict(zip(SPLIT, (
            t1 - t0, t2 - t1, last["fetch_start"] - t2, last["fetch_end"] - last["fetch_start"],
            last["load_start"] - last["fetch_end"], last["applied"] - last["load_start"])))})
        return len(out) / latency / 1e6

    async def baseline() -> float:
        key = f"{_keys(run).prefix}:bench:raw:{len(baseline_runs)}"
        t0 = time.time()
        await transport.raw_send(key, blob)
        t1 = time.time()
        for i in range(actors):
            await client.rpush(f"{lists['cmd']}{i}", _pack({"op": "raw", "key": key}))
        reports = await _collect(client, lists["reports"], actors, receivers, STEP_TIMEOUT_S)
        assert all(r["kind"] == "raw" and r["nbytes"] == len(blob) for r in reports), reports
        await transport.raw_done(key)
        last = max(reports, key=lambda r: r["applied"])
        latency = last["applied"] - t0
        baseline_runs.append({"seconds": latency, "split": dict(zip(BASELINE_SPLIT, (
            t1 - t0, last["get_start"] - t1, last["applied"] - last["get_start"])))})
        return len(blob) / latency / 1e6

    try:
        ready = runner.run(_collect(client, lists["ready"], actors, receivers, START_TIMEOUT_S))
        if warmup:
            runner.run(system())
        first_apply = system_runs.pop() if warmup else None
        runs = alternate({"system": lambda: runner.run(system()), "baseline": lambda: runner.run(baseline())}, repeats)
        started = time.perf_counter()
        hashlib.sha256(blob).hexdigest()
        checksum_s = time.perf_counter() - started  # what publish and fetch+verify each spend on it
        peak_rss = receivers.peak_rss_mb()
        redis_peak = int(runner.run(client.info("memory"))["used_memory_peak"])
    finally:
        receivers.stop()
        runner.run(client.aclose())
    return {
        "model": model.label, "hidden": model.hidden, "layers": model.layers, "heads": model.heads,
        "params": model.params, "bytes": model.nbytes, "transport": transport_name, "actors": actors,
        "engine_start_s": sorted(r["start_s"] for r in ready),
        "system": spread(runs["system"]), "baseline": spread(runs["baseline"]),
        "ratio": ratios(runs["system"], runs["baseline"]),
        "system_mb_s": runs["system"], "baseline_mb_s": runs["baseline"],
        "system_s": spread([r["seconds"] for r in system_runs]),
        "baseline_s": spread([r["seconds"] for r in baseline_runs]),
        "split": _median_run(system_runs)["split"], "baseline_split": _median_run(baseline_runs)["split"],
        "checksum_s": checksum_s, "first_apply": first_apply,
        "system_runs": system_runs, "baseline_runs": baseline_runs,
        "receiver_peak_rss_mb": peak_rss, "redis_peak_mb": redis_peak / 1e6,
    }


def _median_run(runs: list[dict]) -> dict:
    """The repetition of median latency (the lower one of an even count): its parts add up to it."""
    return sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]


async def blob_limit(url: str, try_over: bool) -> dict:
    """Redis's largest bulk value, and (try_over) whether WeightStore.publish of a blob
    1 MiB over it goes through."""
    from redis.exceptions import RedisError

    from broker.connection import connect
    from broker.weights import WeightStore, WeightsTooLarge

    client = connect(url)
    limit = int((await client.config_get("proto-max-bulk-len"))["proto-max-bulk-len"])
    version = (await client.info("server"))["redis_version"]
    result: dict[str, Any] = {"proto_max_bulk_len": limit, "redis_version": version}
    if try_over:
        blob = bytes(limit + (1 << 20))
        try:
            await WeightStore(client, _keys("limit"), keep=1).publish(1, 1, blob)
            result.update(tried_bytes=len(blob), published=True, error=None)
        except (WeightsTooLarge, RedisError, OSError) as exc:
            result.update(tried_bytes=len(blob), published=False, error=f"{type(exc).__name__}: {exc}")
        del blob
        await client.aclose()
        client = connect(url)
        result["server_alive_after"] = bool(await client.ping())
    await client.aclose()
    return result


def run(quick: bool, device: str = "cpu") -> dict:
    import torch

    from broker.embedded import EmbeddedRedis, find_redis_server

    actors = QUICK_ACTORS if quick else ACTORS
    if device == "cuda":
        actors = min(actors, torch.cuda.device_count())
    repeats = QUICK_REPEATS if quick else REPEATS
    points, skipped = [], []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="omrl-bench-weights-") as tmp, \
            EmbeddedRedis(binary=find_redis_server("bundled")) as server, asyncio.Runner() as runner:
        limit = runner.run(blob_limit(server.url, try_over=False))
        for shape in QUICK_MODELS if quick else MODELS:
            model = build_model(tmp, *shape)
            # The checkpoint's safetensors file: the blob's tensors, with a header of about the same size.
            estimate = sum(f.stat().st_size for f in Path(model.path).glob("*.safetensors"))
            if estimate >= limit["proto_max_bulk_len"]:
                skipped.append({"hidden": shape[0], "layers": shape[1], "bytes_about": estimate,
                                "why": f"over Redis proto-max-bulk-len ({limit['proto_max_bulk_len']} bytes)"})
                continue
            for transport in TRANSPORTS:
                point = measure_model(runner, server.url, model, transport, actors, repeats, not quick, device, tmp)
                points.append(point)
                print(f"weights {point['model']:>7} ({point['bytes'] / 1e6:7.1f} MB) {transport}: MB/s system "
                      f"{point['system']['median']:8.1f}  baseline {point['baseline']['median']:8.1f}  "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
            for f in Path(model.path).glob("*.safetensors"):
                f.unlink()  # the next model's engines need the page cache more
        if not quick:
            limit = runner.run(blob_limit(server.url, try_over=True))
            print(f"weights: Redis {limit['redis_version']} proto-max-bulk-len {limit['proto_max_bulk_len']} bytes; "
                  f"publishing {limit['tried_bytes']} bytes: {'ok' if limit['published'] else limit['error']}",
                  flush=True)
    rows = [row(f"{p['model']} params ({p['bytes'] / 1e6:.1f} MB), {p['transport']}: MB/s publish -> applied in "
                f"{p['actors']} actors", p["system_mb_s"], p["baseline_mb_s"]) for p in points]
    return {"points": points, "rows": rows, "blob_limit": limit, "skipped": skipped}


def plot(result: dict, path) -> None:
    plt = pyplot()
    points = result["points"]
    fig, (rate, split) = plt.subplots(1, 2, figsize=(12, 4.8))
    for transport in dict.fromkeys(p["transport"] for p in points):
        ps = [p for p in points if p["transport"] == transport]
        x = [p["bytes"] / 1e6 for p in ps]
        for kind, style, label in (("system", "-o", f"{transport}: publish -> applied"),
                                   ("baseline", "--x", f"{transport}: raw transport")):
            med = [p[kind]["median"] for p in ps]
            err = [[m - p[kind]["min"] for m, p in zip(med, ps)], [p[kind]["max"] - m for m, p in zip(med, ps)]]
            rate.errorbar(x, med, yerr=err, fmt=style, capsize=3, label=label)
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
        share = [p["split"][part] / sum(p["split"].values()) for p in points]
        split.barh(labels, share, left=left, label=part)
        left = [a + b for a, b in zip(left, share)]
    for i, p in enumerate(points):
        split.text(1.01, i, f"{sum(p['split'].values()):.3g} s\n(raw {sum(p['baseline_split'].values()):.3g} s)",
                   va="center", fontsize=8)
    split.set_xlim(0, 1.45)
    split.set_xlabel("share of publish -> applied, last actor (median repetition)")
    split.set_title("where the time goes")
    split.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(SPLIT) // 2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="weights benchmark; --receiver: one actor's receiver (internal)")
    parser.add_argument("--receiver", action="store_true", help="run one receiver for the driver in run()")
    parser.add_argument("--url", help="Redis URL")
    parser.add_argument("--run", help="run name: the keys' prefix")
    parser.add_argument("--model", help="model directory")
    parser.add_argument("--index", type=int, default=0, help="actor index")
    parser.add_argument("--transport", choices=list(TRANSPORTS), default="blob")
    parser.add_argument("--quick", action="store_true", help="without --receiver: the quick run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="without --receiver: where the learner's copy of the model sits")
    args = parser.parse_args(argv)
    from common.logs import setup_logging

    if args.receiver:
        setup_logging(f"weights-receiver{args.index}", "INFO")
        asyncio.run(_receiver(args))
    else:
        import json

        setup_logging("weights", "INFO", stream=sys.stderr)
        print(json.dumps(run(args.quick, args.device)["rows"], indent=1))


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the receiver needs the guard
    main()
