"""torch's DeviceMesh and DTensor beside ddlab's mesh: on 2 data x 2 tensor ranks (gloo), the same groups,
and a block of lab 14's GPT computed from DTensor-placed weights equal to ddlab's ParallelBlock's and to one
process's Block."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddlab.data_parallel.torch_ddp import close_gloo, init_gloo
from ddlab.mesh import DIMS, Mesh
from ddlab.mesh.torch_mesh import BLOCK_PLACEMENTS, dtensor_block, torch_mesh
from ddlab.models.gpt import Block, GPTConfig, make_gpt
from ddlab.runtime.blocks import block_range
from ddlab.tensor_parallel import ParallelBlock
from mpi4py import MPI
from torch.distributed.tensor import Partial, Replicate, Shard

SIZES = {"pipeline": 1, "data": 2, "context": 1, "tensor": 2}


@pytest.fixture
def meshes(comm: MPI.Comm):
    if comm.Get_size() != 4:
        pytest.skip("one layout, 2 data x 2 tensor, on 4 ranks")
    init_gloo(comm)
    ours = Mesh.build(comm, data=2, tensor=2)
    yield ours, torch_mesh(SIZES)
    ours.free()
    close_gloo()


def test_the_device_mesh_has_ddlab_s_groups(comm: MPI.Comm, meshes) -> None:
    ours, theirs = meshes
    for name in DIMS:
        group = dist.get_process_group_ranks(theirs.get_group(name))
        assert group == ours.comms[name].allgather(comm.Get_rank()), name
        assert theirs.get_local_rank(name) == ours.coords[name], name


def test_the_block_from_dtensor_placements_equals_ddlab_s_and_one_process_s(comm: MPI.Comm, meshes) -> None:
    ours, theirs = meshes
    config = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=4, n_embd=16, tied=False)
    block = make_gpt(config, dtype=torch.float64).blocks[0]
    assert isinstance(block, Block)
    torch.manual_seed(1)
    x = torch.randn(4, 8, 16, dtype=torch.float64)  # the whole batch, the same on every rank
    samples = block_range(4, ours.coords["data"], 2)
    mine = x[samples.start : samples.stop]
    ddlab_out = ParallelBlock(block, ours.tensor)(mine)
    torch_out = dtensor_block(block, mine, theirs)
    assert torch_out.placements == (Replicate(), Shard(0), Replicate(), Replicate())
    torch.testing.assert_close(torch_out.to_local(), ddlab_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch_out.full_tensor(), block(x), rtol=0, atol=1e-12)


def test_every_tensor_of_the_block_is_named_a_placement() -> None:
    kinds = {type(p) for pair in BLOCK_PLACEMENTS.values() for p in pair}
    assert kinds == {Shard, Replicate, Partial}
    assert BLOCK_PLACEMENTS["attention output before the sum"][1] == Partial()
