"""`omrl bench broker`: rollout groups through the project's producer and consumer
(RolloutProducer's buffer and flusher, XADD; RolloutConsumer's XREADGROUP, XACK + XDEL),
against raw redis-py moving the same bytes with the same commands on the same server.

Groups of 16 KB, 256 KB and 4 MB (8 samples each), from 1, 4 and 16 concurrent producers
(each its own connection: many actor machines), one consumer reading 16 at a time. Two
system figures: transport alone (pre-encoded bytes), and with the codec (encode_group per
push, decode_group per read). The ratios are groups/s of each against raw redis-py: 1.0
means the project adds nothing to what Redis costs."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np

from benchmarks.common import pyplot, ratios, spread

SIZES = {"16KB": 16 << 10, "256KB": 256 << 10, "4MB": 4 << 20}
PRODUCERS = (1, 4, 16)
BYTES_PER_POINT = 32 << 20  # groups per point: this many bytes' worth (at least 16)
QUICK_BYTES = 1 << 20


def make_group(size: int):
    """A rollout group of 8 samples whose message is about `size` bytes."""
    from common.messages import RolloutGroup, Sample

    tokens = max(8, size // (8 * 13))  # 13 bytes a token: tokens, loss mask, log-prob, version
    samples = [Sample(tokens=np.arange(tokens, dtype=np.int32) % 64, loss_mask=np.ones(tokens, np.uint8),
                      logprobs=np.full(tokens, -0.5, np.float32), versions=np.zeros(tokens, np.int32), reward=1.0,
                      turn_rewards=np.ones(1, np.float32), num_turns=1, finish_reason="done", task_id="0",
                      env_name="bench") for _ in range(8)]
    return RolloutGroup(task_id="0", env_name="bench", actor_id="bench", sampling={}, samples=samples)


async def _system(url: str, group, n: int, producers: int, codec: bool) -> float:
    import redis.asyncio as aioredis

    from broker.keys import Keys
    from broker.streams import RolloutConsumer, RolloutProducer
    from common.messages import decode_group, encode_group

    keys = Keys(run=f"bench-{uuid.uuid4().hex[:8]}")
    blob = encode_group(group, max_bytes=1 << 30)
    clients = [aioredis.from_url(url) for _ in range(producers + 1)]
    consumer = RolloutConsumer(clients[-1], keys, "bench")
    await consumer.ensure_group()
    senders = [RolloutProducer(c, keys, max_len=10 ** 9, buffer_size=16) for c in clients[:-1]]
    flushers = [asyncio.create_task(s.run()) for s in senders]

    async def produce(i: int) -> None:
        for _ in range(i, n, producers):
            await senders[i].push(encode_group(group, max_bytes=1 << 30) if codec else blob)
        await senders[i].flush()

    async def consume() -> None:
        got = 0
        while got < n:
            entries = await consumer.read(count=16, block_ms=1000)
            if codec:
                for entry in entries:
                    decode_group(entry.data, max_bytes=1 << 30)
            await consumer.ack([entry.id for entry in entries])
            got += len(entries)

    started = time.perf_counter()
    await asyncio.gather(*[produce(i) for i in range(producers)], consume())
    elapsed = time.perf_counter() - started
    for task in flushers:
        task.cancel()
    await clients[-1].delete(keys.rollouts())
    for c in clients:
        await c.aclose()
    return n / elapsed


async def _raw(url: str, blob: bytes, n: int, producers: int) -> float:
    import redis.asyncio as aioredis

    stream, group = f"bench-raw-{uuid.uuid4().hex[:8]}", "g"
    clients = [aioredis.from_url(url) for _ in range(producers + 1)]
    reader = clients[-1]
    await reader.xgroup_create(stream, group, id="0", mkstream=True)

    async def produce(i: int) -> None:
        for _ in range(i, n, producers):
            await clients[i].xadd(stream, {b"data": blob})

    async def consume() -> None:
        got = 0
        while got < n:
            reply = await reader.xreadgroup(group, "bench", {stream: ">"}, count=16, block=1000)
            ids = [entry_id for _s, entries in reply or [] for entry_id, _fields in entries]
            if ids:
                async with reader.pipeline(transaction=False) as pipe:
                    pipe.xack(stream, group, *ids)
                    pipe.xdel(stream, *ids)
                    await pipe.execute()
            got += len(ids)

    started = time.perf_counter()
    await asyncio.gather(*[produce(i) for i in range(producers)], consume())
    elapsed = time.perf_counter() - started
    await reader.delete(stream)
    for c in clients:
        await c.aclose()
    return n / elapsed


def run(quick: bool, device: str = "cpu") -> dict:
    from broker.embedded import EmbeddedRedis, find_redis_server
    from common.messages import encode_group

    sizes = {"16KB": SIZES["16KB"]} if quick else SIZES
    repeats = 1 if quick else 3
    points = []
    with EmbeddedRedis(binary=find_redis_server("bundled")) as server:
        for label, size in sizes.items():
            group = make_group(size)
            blob = encode_group(group, max_bytes=1 << 30)
            n = max(16, (QUICK_BYTES if quick else BYTES_PER_POINT) // len(blob))
            for producers in (1,) if quick else PRODUCERS:
                runs: dict[str, list[float]] = {"transport": [], "with_codec": [], "raw": []}
                for _ in range(repeats):  # alternated
                    runs["transport"].append(asyncio.run(_system(server.url, group, n, producers, codec=False)))
                    runs["with_codec"].append(asyncio.run(_system(server.url, group, n, producers, codec=True)))
                    runs["raw"].append(asyncio.run(_raw(server.url, blob, n, producers)))
                point = {"size": label, "bytes": len(blob), "groups": n, "producers": producers,
                         **{k: spread(v) for k, v in runs.items()}}
                for kind in ("transport", "with_codec"):
                    point[f"ratio_{kind}"] = ratios(runs[kind], runs["raw"])
                points.append(point)
                print(f"broker {label:>5} x{producers:<2} groups/s: transport {point['transport']['median']:8.1f}  "
                      f"with codec {point['with_codec']['median']:8.1f}  raw {point['raw']['median']:8.1f}", flush=True)
    rows = [{"measure": f"{p['size']} groups, {p['producers']} producers: groups/s{' with codec' if kind == 'with_codec' else ''}",
             "system": p[kind]["median"], "baseline": p["raw"]["median"], "ratio": p[f"ratio_{kind}"]}
            for p in points for kind in ("transport", "with_codec")]
    return {"points": points, "rows": rows}


def plot(result: dict, path) -> None:
    plt = pyplot()
    sizes = list(dict.fromkeys(p["size"] for p in result["points"]))
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 3.8), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        points = [p for p in result["points"] if p["size"] == size]
        x = [p["producers"] for p in points]
        for kind, style, label in (("transport", "-o", "producer/consumer"), ("with_codec", "-s", "with codec"),
                                   ("raw", "--x", "raw redis-py")):
            mb = [p[kind]["median"] * p["bytes"] / 1e6 for p in points]
            ax.plot(x, mb, style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{size} groups")
        ax.set_xlabel("producers")
        ax.set_ylabel("MB/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
