"""The broadcast transport's shared half: the rendezvous between the learner's rank 0 and
one actor's inference workers, and a weight version's wire format over their group (what
learner/broadcast.py sends and actors/vllm_ext.py receives). torch is imported lazily, so
the message schema stays torch-free.

Rendezvous: the learner hosts a TCPStore. An actor takes a link number (`joins` counter),
writes `join/N` (its name and group size), and its workers and the learner build the group
under the prefix `link/N`: rank 0 the learner, ranks 1.. the actor's workers. One group per
actor, so an actor that joins late, restarts or dies touches no other actor's group. The
actor asks for a version by setting `link/N/want`; the learner then sends the newest one,
so both sides enter the collectives together and a timeout means a dead or hung peer.

A version on the wire: a header (version, layout bytes, bucket count), the layout (msgpack:
each tensor's name, dtype, shape, bucket and byte offset; each bucket's size), then the
buckets: flat uint8 tensors of about `bucket_bytes`, each one broadcast from rank 0.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Iterable, Iterator
from typing import Any

import msgpack

ALIGN = 64  # byte offset of every tensor in its bucket: any dtype's view of it is aligned


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def open_store(host: str, port: int, timeout_s: float, master: bool = False):
    """The learner's TCPStore (master: hosted here, on `port`, 0 for a free one) or a client of it."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=master, timeout=_timeout(timeout_s), wait_for_workers=False)


def open_group(store, link: str, rank: int, world: int, backend: str, timeout_s: float):
    """The group of one link; returns once all `world` ranks have joined (or raises after timeout_s)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(link + "/", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _timeout(timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    return dist.ProcessGroupGloo(prefixed, rank, world, _timeout(timeout_s))


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


def _broadcast(group, tensor) -> None:
    group.broadcast(tensor, 0).wait()


def send_version(group, packed: Packed) -> None:
    import torch

    device = packed.buckets[0].device
    _broadcast(group, torch.tensor([packed.version, len(packed.layout), len(packed.buckets)], dtype=torch.int64,
                                   device=device))
    _broadcast(group, torch.frombuffer(bytearray(packed.layout), dtype=torch.uint8).to(device))
    for bucket in packed.buckets:
        _broadcast(group, bucket)


def receive_version(group, device) -> tuple[int, Iterator[tuple[str, Any]]]:
    """The version's number, and its tensors as they arrive, bucket by bucket (views into the
    bucket: the consumer copies what it keeps). The iterator must be run to its end."""
    import torch

    header = torch.empty(3, dtype=torch.int64, device=device)
    _broadcast(group, header)
    version, layout_bytes, _count = (int(x) for x in header.tolist())
    raw = torch.empty(layout_bytes, dtype=torch.uint8, device=device)
    _broadcast(group, raw)
    layout = msgpack.unpackb(raw.cpu().numpy().tobytes())

    def tensors() -> Iterator[tuple[str, Any]]:
        by_bucket: dict[int, list] = {}
        for entry in layout["tensors"]:
            by_bucket.setdefault(entry[3], []).append(entry)
        for index, size in enumerate(layout["buckets"]):
            bucket = torch.empty(size, dtype=torch.uint8, device=device)
            _broadcast(group, bucket)
            for name, dtype, shape, _bucket, offset in by_bucket.get(index, []):
                dt = getattr(torch, dtype)
                yield name, bucket[offset:offset + math.prod(shape) * dt.itemsize].view(dt).view(shape)

    return version, tensors()
