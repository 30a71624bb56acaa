"""Collectives on the right device (issue 25, defect 1: an NCCL group has no CPU backend, so a
CPU tensor in a collective of the learner's group killed every multi-GPU run at step 1).

The learner's group has a backend for every device type its tensors can be on, each collective
checks it, and the trainer never builds a tensor for a collective: it hands Python numbers to
`parallel.sum`. Emulated here on a CPU: a group with only an NCCL backend refuses a CPU tensor,
as NCCL does. On a GPU, tests/integration/test_gpu.py trains through a real NCCL group."""

import ast
import gc
from pathlib import Path

import pytest
import torch

from learner.distributed import Single, _Distributed, backends_for

ROOT = Path(__file__).resolve().parents[2]
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "send", "recv", "barrier"}


def test_a_cuda_group_has_a_backend_for_cpu_tensors_too():
    assert backends_for(torch.device("cuda", 3)) == {"cpu": "gloo", "cuda": "nccl"}
    assert backends_for(torch.device("cpu")) == {"cpu": "gloo"}


def test_a_collective_refuses_a_tensor_whose_device_has_no_backend():
    nccl_only = object.__new__(_Distributed)  # as an NCCL-only group would be: no process group needed
    nccl_only.device, nccl_only.backends = torch.device("cpu"), {"cuda": "nccl"}
    with pytest.raises(RuntimeError, match=r"a cpu tensor, but the learner's group has backends for \['cuda'\] only"):
        nccl_only.sum([1.0, 2.0])
    assert Single(torch.device("cpu")).sum([1.0, 2.0]) == [1.0, 2.0]


def test_only_the_parallel_layer_calls_collectives():
    """torch.distributed's collectives are called in learner/distributed.py and
    learner/vocab_parallel.py (checked there) and in the weight transport's rendezvous
    (common/weight_sync.py, which sends on the group's device); the trainer and the worker go
    through `parallel`, and nothing calls an `all_reduce` of theirs."""
    allowed = {"learner/distributed.py", "learner/vocab_parallel.py", "common/weight_sync.py"}
    offenders = []
    # The project's own folders only: a walk of .venv (in CI, inside the clone) allocates enough to
    # run a full collection mid-test, which once finalized an earlier test's vLLM client and hung in
    # its zmq context's term().
    tops = [p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "tests"]
    for path in sorted(path for top in tops for path in top.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in allowed:
            continue
        for node in ast.walk(_parse(path.read_text(), rel)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id in ("dist", "distributed") or node.func.attr == "all_reduce":
                    offenders.append(f"{rel}:{node.lineno} {ast.unparse(node.func)}")
    assert offenders == [], offenders


def _parse(source: str, name: str) -> ast.AST:
    """ast.parse with the collector off. On Python 3.11.7 (CI's) the AST builder keeps one
    recursion counter for the interpreter; a collection during the build that finalizes an
    earlier test's vLLM engine runs Python code mid-build (and lets other threads in), and the
    build ends with "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905).
    With the collector off no Python code runs until the build is done."""
    gc.disable()
    try:
        return ast.parse(source, name)
    finally:
        gc.enable()


def test_the_vocabulary_split_refuses_a_tensor_off_its_weights_device():
    """The embedding and output layer split by vocabulary exchange activations on the weight's
    device (CUDA under NCCL): a CPU tensor, or a view a collective would fill a copy of, is refused."""
    from learner.vocab_parallel import VocabRows

    on_gpu = object.__new__(VocabRows)  # as on a GPU rank: no process group needed to refuse
    on_gpu.device = torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="a tensor on cpu, its group's is cuda:0"):
        on_gpu.combine(torch.zeros(3))
    on_cpu = object.__new__(VocabRows)
    on_cpu.device = torch.device("cpu")
    with pytest.raises(ValueError, match="non-contiguous"):
        on_cpu.combine(torch.zeros(4, 2)[:, 1])
