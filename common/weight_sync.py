"""The broadcast transport's shared half: the rendezvous between the learner's rank 0 and the
actors, and a weight version's wire format down their group (what learner/broadcast.py sends
and actors/weights.py relays). torch is imported lazily, so the message schema stays torch-free.

One group for all receivers. The learner hosts a TCPStore. An actor joins by taking a number
(`JOINS` counter) and writing `join/N` (its name), and leaves by appending its number to the
leave list. The learner sends each version as a *send* K, written to `send/K` before it starts:
the epoch (a group), its members in chain order (join numbers) and the version. The group of
an epoch is built once (rank 0 the learner, rank i the i-th member) and kept for every send
while the members stay the same; a join, a leave or a failure starts a new epoch. Members
announce themselves ready for a new epoch (`epoch/E/ready/N`) and build the group once the
learner says go (`epoch/E/go`: "1", or "0" when a member never came and the epoch is given up).

The version travels down a chain: the learner sends each bucket to rank 1 only, rank i
receives it from i - 1 and passes it to i + 1 while it writes it. The learner sends each byte
once whatever the number of actors; each actor receives once and sends once (as NCCL's ring
broadcast does). Each member then reports the send's outcome (`send/K/got/N` or
`send/K/failed/N`, and the `send/K/done` counter), so the learner knows who has the version,
who must build a new group, and who said nothing (dropped: `dropped/N`, after which the actor
joins again under a new number).

A member beats a heartbeat (`alive/N` counter) from a thread of its own; the learner drops a
member whose heartbeat stood still for `STALE_S` before it sends, so a dead actor costs the
others nothing once it has been silent that long, and one timeout when it dies mid-send.

A version on the wire: a header (version, layout bytes, bucket count), the layout (msgpack:
each tensor's name, dtype, shape, bucket and byte offset; each bucket's size), then the
buckets: flat uint8 tensors of about `bucket_bytes`.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Iterable, Iterator
from typing import Any

import msgpack

ALIGN = 64  # byte offset of every tensor in its bucket: any dtype's view of it is aligned
JOINS, LEAVES, SENDS = "joins", "leaves", "sends"  # counters
HEARTBEAT_S = 1.0  # how often a member beats
POLL_S = 0.05  # how often the store is polled for a key (its own wait logs a warning at each timeout)
LOCAL_FAILURE = b"local"  # a member's failed mark when it relayed the version but could not stage it
STALE_S = 10.0  # a member whose heartbeat stood still this long is dropped before a send


def join_key(n: int) -> str:
    return f"join/{n}"


def leave_key(i: int) -> str:
    return f"leave/{i}"


def dropped_key(n: int) -> str:
    return f"dropped/{n}"


def alive_key(n: int) -> str:
    return f"alive/{n}"


def send_key(k: int, what: str = "", n: int | None = None) -> str:
    """`send/K` (the plan), or its `done` counter, or member N's `got` / `failed` mark."""
    return f"send/{k}" + (f"/{what}" if what else "") + (f"/{n}" if n is not None else "")


def epoch_key(e: int, what: str, n: int | None = None) -> str:
    return f"epoch/{e}/{what}" + (f"/{n}" if n is not None else "")


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def open_store(host: str, port: int, timeout_s: float, master: bool = False):
    """The learner's TCPStore (master: hosted here, on `port`, 0 for a free one) or a client of it."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=master, timeout=_timeout(timeout_s), wait_for_workers=False)


def open_group(store, epoch: int, rank: int, world: int, timeout_s: float):
    """The gloo group of one epoch; returns once all `world` ranks have joined (or raises after timeout_s)."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore(f"epoch/{epoch}/group/", store), rank, world, _timeout(timeout_s))


@dataclasses.dataclass
class Packed:
    """A weight version ready to send: the layout and the buckets (copies: training goes on)."""

    version: int
    layout: bytes
    buckets: list[Any]  # uint8 tensors
    nbytes: int


def pack(version: int, tensors: Iterable[tuple[str, Any]], bucket_bytes: int, device) -> Packed:
    """The (name, tensor) pairs in buckets of at most `bucket_bytes` (a larger tensor gets one of
    its own) on `device`. The pairs may come one at a time (a generator): a bucket is filled
    once it is full, so what packing holds besides the buckets is one bucket's tensors."""
    import torch

    entries, buckets, pending, offset = [], [], [], 0

    def seal() -> None:
        bucket = torch.empty(offset, dtype=torch.uint8, device=device)
        for tensor, start in pending:
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            bucket[start:start + flat.numel()].copy_(flat)
        buckets.append(bucket)
        pending.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if offset and offset + nbytes > bucket_bytes:
            seal()
            offset = 0
        entries.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), len(buckets), offset])
        pending.append((tensor, offset))
        offset += -(-nbytes // ALIGN) * ALIGN
    seal()
    sizes = [b.numel() for b in buckets]
    layout = msgpack.packb({"tensors": entries, "buckets": sizes})
    return Packed(version, layout, buckets, sum(sizes))


def send_version(group, packed: Packed) -> None:
    """Rank 0: the version to rank 1, the head of the chain (each piece queued at once; returns
    when all of it is sent)."""
    import torch

    pieces = [torch.tensor([packed.version, len(packed.layout), len(packed.buckets)], dtype=torch.int64),
              torch.frombuffer(bytearray(packed.layout), dtype=torch.uint8), *packed.buckets]
    for work in [group.send([piece], 1, 0) for piece in pieces]:
        work.wait()


def relay_version(group, rank: int, world: int) -> tuple[int, list[tuple[str, str, list[int]]], Iterator]:
    """Rank > 0: the version's number, its layout [(name, dtype, shape)] and its tensors as they
    arrive from rank - 1 (views into their bucket: the consumer copies what it keeps), each
    bucket passed on to rank + 1 (unless this rank is the last) while the consumer takes it.
    The iterator must be run to its end: the ranks after this one wait for every bucket."""
    import torch

    after = rank + 1 if rank + 1 < world else None

    def relay(tensor):
        group.recv([tensor], rank - 1, 0).wait()
        return None if after is None else group.send([tensor], after, 0)

    header = torch.empty(3, dtype=torch.int64)
    sending = [relay(header)]
    version, layout_bytes, _count = (int(x) for x in header.tolist())
    raw = torch.empty(layout_bytes, dtype=torch.uint8)
    sending.append(relay(raw))
    layout = msgpack.unpackb(raw.numpy().tobytes())

    def tensors() -> Iterator[tuple[str, Any]]:
        by_bucket: dict[int, list] = {}
        for entry in layout["tensors"]:
            by_bucket.setdefault(entry[3], []).append(entry)
        for index, size in enumerate(layout["buckets"]):
            bucket = torch.empty(size, dtype=torch.uint8)
            sending.append(relay(bucket))  # passed on while the consumer takes it
            for name, dtype, shape, _bucket, offset in by_bucket.get(index, []):
                dt = getattr(torch, dtype)
                yield name, bucket[offset:offset + math.prod(shape) * dt.itemsize].view(dt).view(shape)
            while len(sending) > 1:  # at most this bucket's send in flight: two buckets held
                work = sending.pop(0)
                if work is not None:
                    work.wait()
        for work in sending:
            if work is not None:
                work.wait()

    return version, [(name, dtype, shape) for name, dtype, shape, _b, _o in layout["tensors"]], tensors()
