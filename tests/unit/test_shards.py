"""A learner rank reads its piece of each sharded tensor from the safetensors files as FSDP2
cuts it (torch.chunk along the shard's dimension), and along dim 0, FSDP2's, only its rows:
no rank reads a whole tensor it shards (issue 25, defect 2)."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from learner.distributed import shard_of


class RowsOnly:
    """A safetensors file that refuses to hand out a whole tensor."""

    def __init__(self, f):
        self.f = f

    def get_slice(self, name):
        return self.f.get_slice(name)

    def get_tensor(self, name):
        raise AssertionError(f"{name} was read whole")


@pytest.mark.parametrize(("rows", "world"), [(10, 3), (7, 4), (2, 4), (8, 2), (5, 1)])
@pytest.mark.parametrize("dim", [0, 1])
def test_each_rank_gets_torch_chunks_piece_and_reads_only_its_rows(tmp_path, rows, world, dim):
    shape = (rows, 3) if dim == 0 else (3, rows)
    full = torch.arange(rows * 3, dtype=torch.float32).reshape(shape)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    chunks = torch.chunk(full, world, dim=dim)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt", device="cpu") as f:
        source = RowsOnly(f) if dim == 0 else f
        pieces = [shard_of(source, "w", dim, rank, world) for rank in range(world)]
    for rank, piece in enumerate(pieces):
        expected = chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)
        assert piece.shape == expected.shape and torch.equal(piece, expected), (rank, piece, expected)
    assert torch.equal(torch.cat(pieces, dim=dim), full)
