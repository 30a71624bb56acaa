"""torch.distributed for the learner, applied once from config (as torchtitan's
`parallelize_llama`): the trainer calls these methods and never branches on the kind.

- `single`: one process, no process group.
- `ddp`: every rank holds the whole model; gradients are all-reduced (averaged) on the last
  micro-batch of each optimizer step.
- `fsdp2`: `fully_shard` per decoder layer and on the root: parameters, gradients and
  optimizer state are sharded across ranks. The model is built on the meta device, its
  decoder layers sharded, and each rank reads only its shard of every layer's tensors from
  the safetensors files (`load_model`). The embedding and the output layer are split by
  vocabulary (learner.vocab_parallel, `learner/vocab_parallel.py`): each rank reads and keeps
  its rows and FSDP2 leaves them alone (`ignored_params`); the rest (final norm, a value
  head; the embedding and output layer when not split) is sharded by `wrap`, whose root unit is
  the scorer that calls them: no rank ever holds a whole copy of the model, and with the split
  no rank ever gathers the embedding either. With learner.precision = "bf16" the shards are
  gathered in bf16 for compute and gradients reduced in fp32 (a MixedPrecisionPolicy).

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK. On CUDA the group has NCCL for CUDA tensors
and gloo for CPU ones ("cpu:gloo,cuda:nccl": an NCCL-only group fails on the first CPU
tensor); on CPU it is gloo. The control messages (rank 0's plan for each step) go over a
gloo group. The trainer's own reductions go through `sum`, which takes Python numbers and
puts them on the training device itself: no caller picks a tensor's device for a
collective, and every collective here checks that its tensor's device has a backend.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def resolve_device(name: str, local_rank: int) -> torch.device:
    """learner.device -> a torch device; `auto` is CUDA when present, one GPU per local rank."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: learner.device is 'cuda' but torch sees no CUDA GPU: set learner.device=cpu "
                             "or install the CUDA build of torch")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class Single:
    """One process: every collective is the identity."""

    rank, world, is_main = 0, 1, True
    checkpoint_group = None  # the process group checkpoints are saved over (none: one process)

    def __init__(self, device: torch.device):
        self.device = device

    def wrap(self, module: torch.nn.Module, frozen: bool = False) -> torch.nn.Module:
        """`module` as this parallel layer trains it (`frozen`: a model that only scores, such as
        the KL reference: sharded, never wrapped for gradients)."""
        return module.to(self.device)

    def load_model(self, path: str, dtype: str = "float32", trainable: bool = True) -> torch.nn.Module:
        """The causal LM of `path` in `dtype` (a frozen one with trainable=False), as this rank
        holds it: here whole, on the CPU (the trainer places it)."""
        from common.models import load_causal_lm

        model = load_causal_lm(path, dtype)
        return model if trainable else model.eval().requires_grad_(False)

    @contextlib.contextmanager
    def no_grad_sync(self, module: torch.nn.Module, skip: bool) -> Iterator[None]:
        """Around a micro-batch's backward: skip the gradient exchange (all but the last)."""
        yield

    def gathered(self, module: torch.nn.Module, dtype: torch.dtype | None = None
                 ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The module's state (parameters and persistent buffers) whole, one tensor at a time, as
        new CPU tensors in `dtype` (their own when None) on rank 0 and None elsewhere; named as
        `train_state` names them, a tied weight once (its first name). A sharded tensor is
        gathered, cast on the device and copied out before the next one: what publishing adds
        to the learner's memory is the copy it keeps, plus one tensor whole in its training
        dtype, never a whole fp32 copy of the model first. Every rank must run it to its end."""
        from torch.distributed.tensor import DTensor

        for name, value in _named_state(module):
            sharded = isinstance(value, DTensor)
            whole = value.full_tensor() if sharded else value.detach()  # a collective: every rank
            if not self.is_main:
                yield name, None
                continue
            with torch.no_grad():
                out = whole.to(dtype or whole.dtype).to("cpu").contiguous()
                if not sharded and out.data_ptr() == whole.data_ptr():  # to() changed nothing: copy it,
                    out = out.clone()  # training goes on
            yield name, out
            del whole, out

    def layout(self, module: torch.nn.Module, dtype: torch.dtype | None = None
               ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, whole shape, dtype) of each tensor `gathered` yields, in its order, without
        gathering anything (a file's header can be written before its first tensor)."""
        return [(name, tuple(value.shape), dtype or value.dtype) for name, value in _named_state(module)]

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (float64)."""
        return list(values)

    def train_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """{"model": ..., "optimizer": ...}: the training's own state as this rank holds it (its
        shards under FSDP2, whole in one process and under DDP), the live tensors, named by
        parameter path (no wrapper prefix): what a checkpoint saves from and loads into
        (`learner.checkpoint`). A tied weight appears once, under its first name. Every rank
        must call it."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from learner.checkpoint import MODEL, OPTIMIZER

        model_state, optim_state = get_state_dict(module, optimizer)
        for alias in tied_names(module):
            model_state.pop(alias, None)
        return {MODEL: model_state, OPTIMIZER: optim_state}

    def load_train_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Set the training's state from `state` (`train_state`'s shape, filled from a checkpoint
        written at any rank count). Every rank must call it."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from learner.checkpoint import MODEL, OPTIMIZER

        model_state = dict(state[MODEL])
        for alias, name in tied_names(module).items():  # the tied weight is one tensor: set under both names
            model_state[alias] = model_state[name]
        set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=state[OPTIMIZER])

    def close(self) -> None:
        pass


def backends_for(device: torch.device) -> dict[str, str]:
    """{device type: backend} of the learner's process group on `device`."""
    return {"cpu": "gloo", "cuda": "nccl"} if device.type == "cuda" else {"cpu": "gloo"}


class _Distributed(Single):
    def __init__(self, device: torch.device, precision: str = "fp32"):
        super().__init__(device)
        self.precision = precision  # learner.precision: FSDP2's mixed-precision policy follows it
        self.backends = backends_for(device)
        backend = ",".join(f"{kind}:{name}" for kind, name in self.backends.items())
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None,
                                timeout=datetime.timedelta(minutes=30))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        # Control messages (bytes) on the CPU, whatever the device.
        self.control = dist.new_group(backend="gloo") if device.type != "cpu" else dist.group.WORLD
        # A checkpoint written in the background runs its collectives from a thread while training
        # runs its own: a group of its own (gloo: the state is staged on the CPU), never the training's.
        self.checkpoint_group = dist.new_group(backend="gloo")
        log.info("rank %d of %d on %s (%s)", self.rank, self.world, device, self.backends[device.type])

    def checked(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, refused unless the group has a backend for its device (what NCCL enforces with
        "No backend type associated with device type cpu", checked here on every device)."""
        if t.device.type not in self.backends:
            raise RuntimeError(f"a collective was handed a {t.device.type} tensor, but the learner's group has "
                               f"backends for {sorted(self.backends)} only: make it on {self.device}")
        return t

    def sum(self, values: list[float]) -> list[float]:
        t = self.checked(torch.tensor(values, dtype=torch.float64, device=self.device))
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if self.is_main else 0], dtype=torch.long)  # the control group: CPU
        dist.broadcast(size, 0, group=self.control)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_main else \
            torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.control)
        return data if self.is_main else buf.numpy().tobytes()

    def close(self) -> None:
        dist.destroy_process_group()


class DDP(_Distributed):
    def wrap(self, module: torch.nn.Module, frozen: bool = False) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        module.to(self.device)
        if frozen:
            return module
        return DistributedDataParallel(module, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    @contextlib.contextmanager
    def no_grad_sync(self, module: torch.nn.Module, skip: bool) -> Iterator[None]:
        with module.no_sync() if skip else contextlib.nullcontext():
            yield


class FSDP2(_Distributed):
    def __init__(self, device: torch.device, precision: str = "fp32", vocab_parallel: bool = True):
        from torch.distributed.device_mesh import init_device_mesh

        super().__init__(device, precision)
        self.mesh = init_device_mesh(device.type, (self.world,))
        self.vocab_parallel = vocab_parallel  # learner.vocab_parallel

    def _shard(self, module: torch.nn.Module, frozen: bool = False, ignored: set | None = None) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Trained weights in bf16 compute: gathered in bf16, gradients reduced in fp32 (the shards,
        # AdamW's state and the update stay fp32). A frozen model keeps the dtype it was built in.
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.precision == "bf16" and not frozen else MixedPrecisionPolicy()
        fully_shard(module, mesh=self.mesh, mp_policy=policy, ignored_params=ignored)

    def _split_vocabulary(self, module: torch.nn.Module) -> set:
        """With learner.vocab_parallel, the embedding and output layer of the causal LM in `module`
        split by vocabulary (`learner.vocab_parallel`); the parameters FSDP2 must leave alone."""
        from learner.vocab_parallel import split_vocabulary

        return set(split_vocabulary(getattr(module, "lm", module), self.mesh)) if self.vocab_parallel else set()

    def wrap(self, module: torch.nn.Module, frozen: bool = False) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        module.to(self.device)
        for layer in decoder_layers(module):
            if not isinstance(layer, FSDPModule):  # load_model sharded them already
                self._shard(layer, frozen)
        # The rest (final norm, a value head; the embeddings and output layer unless split by
        # vocabulary) as one unit, rooted at the module whose forward calls them (the scorer calls
        # the decoder and the output layer itself).
        self._shard(module, frozen, self._split_vocabulary(module))
        return module

    def load_model(self, path: str, dtype: str = "float32", trainable: bool = True) -> torch.nn.Module:
        """Built on the meta device, its decoder layers sharded, materialised empty on this rank's
        device, then filled tensor by tensor from the safetensors files, each rank copying only
        its rows of the layers' tensors; the root's (embeddings, final norm, output layer) come
        whole until `wrap` shards them."""
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        if not trainable:
            model.eval().requires_grad_(False)
        for layer in decoder_layers(model):
            self._shard(layer, frozen=not trainable)
        self._split_vocabulary(model)
        model.to_empty(device=self.device)
        model.tie_weights()  # to_empty gave the output layer a tensor of its own: tie it to the embedding again
        for module in model.modules():  # buffers are not in the files (rotary frequencies): computed again
            if next(module.buffers(recurse=False), None) is not None:
                model._init_weights(module)
        load_shards(model, path, self.rank, self.world)
        return model

    @contextlib.contextmanager
    def no_grad_sync(self, module: torch.nn.Module, skip: bool) -> Iterator[None]:
        module.set_requires_gradient_sync(not skip)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)


def _named_state(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's state-dict entries (parameters and persistent buffers, sharded as they are
    held), named as `train_state` names them (no DDP `module.` prefix), a tied weight once."""
    aliases = tied_names(module)
    for name, value in module.state_dict(keep_vars=True).items():
        name = name.removeprefix("module.")
        if name not in aliases:
            yield name, value


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """{alias: first name} of parameters that appear under two names (a tied output layer), in
    state-dict names (no DDP `module.` prefix)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        name = name.removeprefix("module.")
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def load_shards(model: torch.nn.Module, path: str, rank: int, world: int) -> None:
    """Fill `model`'s parameters from the safetensors files in `path`, one tensor at a time: of a
    sharded one (a DTensor sharded on one dimension, as fully_shard makes them) this rank's rows,
    of the others the whole tensor. A parameter the files do not hold (other than a tied output
    layer, which is the embedding) fails, naming it."""
    import json

    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    index = Path(path) / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        ["model.safetensors"]
    params = dict(model.named_parameters())  # a tied output layer appears once, as the embedding
    loaded = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(Path(path) / file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    param = params.get(name)
                    if param is None:
                        continue  # a tied output layer saved anyway, or a buffer
                    if isinstance(param, DTensor):
                        [placement] = param.placements
                        local, mine = param.to_local(), shard_of(f, name, placement.dim, rank, world)
                    else:
                        local, mine = param, f.get_tensor(name)
                    if local.shape != mine.shape:
                        raise RuntimeError(f"{path}: {name}'s shard on rank {rank} is {tuple(local.shape)}, the "
                                           f"file's rows for it {tuple(mine.shape)}")
                    local.copy_(mine)
                    loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise RuntimeError(f"{path}: the safetensors files hold no {missing[:5]} ({len(missing)} missing)")


def shard_of(f, name: str, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of tensor `name` in an open safetensors file, cut along `dim` as
    torch.chunk cuts it (FSDP2's Shard: ceil(n / world) rows a rank, the last ranks short or
    empty). Along dim 0 only those rows are read from the file."""
    if dim != 0:
        full = f.get_tensor(name)
        chunks = torch.chunk(full, world, dim=dim)
        return chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)
    rows = f.get_slice(name)
    shape = rows.get_shape()
    start, stop = chunk_rows(shape[0], rank, world)
    return rows[start:stop] if stop > start else torch.empty((0, *shape[1:]))


def chunk_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's rows of `n`, cut as torch.chunk (and FSDP2's Shard) cuts them."""
    size = -(-n // world)
    start = min(n, rank * size)
    return start, min(n, start + size)


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face decoder (`model.layers` in Qwen2 and Llama)."""
    found = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not found:
        raise ValueError(f"{type(module).__name__}: no ModuleList of decoder layers to shard")
    return list(max(found, key=len))


KINDS = {"ddp": DDP, "fsdp2": FSDP2}


def setup(parallel: str, device_name: str, precision: str = "fp32", vocab_parallel: bool = True) -> Single:
    """The process's place in the learner: `single` unless torchrun started it with WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device_name, int(os.environ.get("LOCAL_RANK", "0")))
    if world == 1:
        return Single(device)
    if parallel == "fsdp2":
        return FSDP2(device, precision, vocab_parallel)
    return KINDS[parallel](device, precision)
