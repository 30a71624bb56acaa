"""`omrl bench fanout`: the broadcast transport's learner side against the number of actors
(issue 25: flat in the number of receivers).

One learner (a `BroadcastSender` in this process, as learner/worker.py's rank 0 runs it:
packed buckets handed over, the record announced in Redis) and 1, 2, 4 and 8 receiver
processes (`python -m benchmarks.fanout --receiver ...`), each the actor's own receiver
(`receive_weights` with a `BroadcastLink` and a `WeightGate`, actors/worker.py's pieces)
around a loader that reads the staged safetensors file whole (what vLLM's reload reads; the
engine itself is left out so that eight fit beside each other on this machine). A version
is `--mb` MB of fp32 tensors (1024 x 1024) in buckets of weights.bucket_mb (256 MB); for each
receiver count, fresh receivers join on a first version (untimed), then each repetition
publishes a newer one.

Per receiver count and repetition: the learner's send (the seconds its sender spends in
`send_version`: how long a version occupies the learner and its network), the bytes it sent,
and the time from handing the version over until every receiver has it staged and loaded.
Ratios against 1 receiver in the same run: bytes are flat by construction (the learner
sends to the head of the chain only; with a group per actor they grew as the count), time
grows by the chain's relay (each receiver passes every bucket on while it writes it) and, on
a 2-core machine, by the receivers sharing the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import msgpack

from benchmarks.common import pyplot, spread

COUNTS = (1, 2, 4, 8)
REPEATS = 5


async def _receiver(url: str, run: str, index: int) -> None:
    """One actor's receiver: joins on the first broadcast record, stages and loads each version,
    reports it (RPUSH) with the time it was loaded."""
    from safetensors.torch import load_file

    from actors.weights import BroadcastLink, WeightGate, receive_weights
    from broker.connection import connect
    from broker.keys import Keys
    from broker.weights import WeightStore
    from common.config import WeightsConfig

    client, stop = connect(url), asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    staging = tempfile.mkdtemp(prefix="omrl-fanout-")
    link = BroadcastLink(f"fanout-{index}", staging, WeightsConfig().timeout_s)
    applying = [0]

    class Gate(WeightGate):
        async def apply(self, version, loader):
            applying[0] = version
            await super().apply(version, loader)

    async def load(path: str) -> None:
        state = await asyncio.to_thread(load_file, path)
        await client.rpush(_reports(run), msgpack.packb({"index": index, "version": applying[0],
                                                         "nbytes": sum(t.numel() * 4 for t in state.values()),
                                                         "loaded": time.time()}))

    try:
        await receive_weights(WeightStore(client, Keys(run)), Gate(0), load, 0.2, stop, link=link)
    finally:
        link.close()
        await client.aclose()
        shutil.rmtree(staging, ignore_errors=True)


def _reports(run: str) -> str:
    return f"{run}:fanout:reports"


async def _measure(url: str, count: int, repeats: int, tensors: int, bucket: int) -> dict:
    """`count` fresh receivers; a first version they join on, then `repeats` timed ones."""
    import torch

    from broker.connection import connect
    from broker.keys import Keys
    from broker.weights import WeightStore
    from common.config import WeightsConfig
    from common.weight_sync import pack
    from learner.broadcast import BroadcastSender

    run_name = f"fanout-{uuid.uuid4().hex[:8]}"
    sender = BroadcastSender("127.0.0.1", 0, WeightsConfig().timeout_s)
    client = connect(url)
    store = WeightStore(client, Keys(run_name))
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.fanout", "--receiver", url, run_name, str(i)])
             for i in range(count)]
    runs = []
    try:
        for version in range(1, repeats + 2):  # the first: the receivers join (untimed)
            torch.manual_seed(version)
            packed = pack(version, ((f"t{i}", torch.randn(1024, 1024)) for i in range(tensors)), bucket, "cpu")
            sends, nbytes = sender.sends, sender.bytes_sent
            started = time.time()
            await store.announce(sender.publish(packed, step=version))
            loaded = []
            while len(loaded) < count:
                reply = await client.blpop([_reports(run_name)], timeout=600)
                if reply is None:
                    raise TimeoutError(f"{count} receivers: version {version} not loaded by every one in 600 s")
                report = msgpack.unpackb(reply[1])
                if report["version"] == version:
                    loaded.append(report["loaded"])
            sender.settled(600)  # its counters final for this version
            if version > 1:
                runs.append({"learner_send_s": sender.last_send_s, "bytes": sender.bytes_sent - nbytes,
                             "sends": sender.sends - sends, "all_loaded_s": max(loaded) - started})
                print(f"fanout: {count} receivers, version {version}: the learner sent {runs[-1]['bytes'] / 1e6:.0f} MB "
                      f"in {runs[-1]['learner_send_s']:.2f} s, all loaded after {runs[-1]['all_loaded_s']:.2f} s",
                      flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
        sender.close()
        await client.aclose()
    return {"receivers": count, "runs": runs, "groups": sender.epochs}


def run(quick: bool, device: str = "cpu") -> dict:
    from broker.embedded import EmbeddedRedis
    from common.config import WeightsConfig

    counts, repeats, mb = ((1, 2), 1, 16) if quick else (COUNTS, REPEATS, 512)
    bucket = (4 if quick else WeightsConfig().bucket_mb) << 20
    with EmbeddedRedis() as server:
        points = [asyncio.run(_measure(server.url, count, repeats, mb // 4, bucket)) for count in counts]
    base = points[0]["runs"]
    rows = []
    for p in points[1:]:
        for key, what in (("bytes", "bytes the learner sent per version (flat is 1)"),
                          ("learner_send_s", "seconds the learner spent sending a version"),
                          ("all_loaded_s", "seconds from handing a version over until every receiver loaded it")):
            system, baseline = [r[key] for r in p["runs"]], [r[key] for r in base]
            rows.append({"measure": f"{p['receivers']} receivers / 1 receiver: {what}",
                         "system": float(sum(system) / len(system)), "baseline": float(sum(baseline) / len(baseline)),
                         "ratio": spread([s / b for s, b in zip(system, baseline)])})
    return {"rows": rows, "points": points, "version_mb": mb, "bucket_mb": bucket >> 20}


def plot(result: dict, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    xs = [p["receivers"] for p in result["points"]]
    for key, label in (("learner_send_s", "learner's send"), ("all_loaded_s", "until every receiver loaded it")):
        axes[0].plot(xs, [sum(r[key] for r in p["runs"]) / len(p["runs"]) for p in result["points"]], "o-", label=label)
    axes[0].set_xlabel("receivers")
    axes[0].set_ylabel("seconds per version")
    axes[0].legend(fontsize=8)
    axes[1].plot(xs, [sum(r["bytes"] for r in p["runs"]) / len(p["runs"]) / 1e6 for p in result["points"]], "o-",
                 label="one group, a chain (measured)")
    axes[1].plot(xs, [x * result["version_mb"] * 1.048576 for x in xs], "--", label="a group per actor (before: N copies, arithmetic)")
    axes[1].set_xlabel("receivers")
    axes[1].set_ylabel("MB the learner sends per version")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    fig.suptitle(f"broadcast: a {result['version_mb']} MB version, buckets of {result['bucket_mb']} MB", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--receiver", nargs=3, metavar=("URL", "RUN", "INDEX"), required=True)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    asyncio.run(_receiver(args.receiver[0], args.receiver[1], int(args.receiver[2])))
