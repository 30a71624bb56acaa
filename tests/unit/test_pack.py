"""common.weight_sync.pack from a stream of tensors (as the learner gathers them, one at a
time): every tensor lands whole where the layout says, no bucket is over its size unless one
tensor alone is, and the stream is read once, in order."""

import math

import msgpack
import torch

from common.weight_sync import ALIGN, pack


def unpacked(packed) -> dict[str, torch.Tensor]:
    layout = msgpack.unpackb(packed.layout)
    assert layout["buckets"] == [b.numel() for b in packed.buckets] and packed.nbytes == sum(layout["buckets"])
    out = {}
    for name, dtype, shape, bucket, offset in layout["tensors"]:
        assert offset % ALIGN == 0
        dt = getattr(torch, dtype)
        raw = packed.buckets[bucket][offset:offset + math.prod(shape) * dt.itemsize]
        out[name] = raw.view(dt).view(shape)
    return out


def test_a_stream_packs_into_buckets_that_unpack_to_the_same_tensors():
    torch.manual_seed(0)
    state = {"a": torch.randn(10, 3), "b": torch.randn(2000).to(torch.bfloat16), "c": torch.arange(7),
             "d": torch.randn(4, 4), "e": torch.randn(3).to(torch.bfloat16)}
    seen = []

    def stream():
        for name, tensor in state.items():
            seen.append(name)
            yield name, tensor

    packed = pack(3, stream(), bucket_bytes=1024, device="cpu")
    assert seen == list(state) and packed.version == 3
    assert unpacked(packed).keys() == state.keys()
    assert all(torch.equal(unpacked(packed)[k], v) for k, v in state.items())
    layout = msgpack.unpackb(packed.layout)
    sizes = layout["buckets"]
    big = {e[3] for e in layout["tensors"] if e[0] == "b"}  # 4,000 bytes: a bucket of its own
    assert all(size <= 1024 for i, size in enumerate(sizes) if i not in big) and len(sizes) >= 3
    assert [e[0] for e in layout["tensors"] if e[3] in big] == ["b"]


def test_an_empty_stream_is_one_empty_bucket():
    packed = pack(1, iter(()), bucket_bytes=1024, device="cpu")
    assert [b.numel() for b in packed.buckets] == [0] and packed.nbytes == 0
