"""torch's ZeRO-1 and FSDP2 beside ddlab's (gloo): what `held_bytes` counts per rank after an Adam step, exactly
for DDP, ddlab's ZeRO-3 and ZeroRedundancyOptimizer (whose partition by whole tensors is uneven), within
padding for FSDP2. Every rank asserts on values agreed with collectives."""

from __future__ import annotations

import torch
from ddlab import sharded
from ddlab.data import StressStrainCurves
from ddlab.data_parallel import DataParallel, close_gloo, init_gloo, squared_error
from ddlab.models import make_mlp
from mpi4py import MPI
from torch import nn

HIDDEN = (48, 32, 17)
STEP = 4  # Adam's step count: a float32 scalar tensor per parameter it updates


def one_step(comm: MPI.Comm, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x, y = StressStrainCurves(n=4 * comm.Get_size(), seed=3)[list(range(4 * comm.Get_rank(), 4 * comm.Get_rank() + 4))]
    optimizer.zero_grad()
    squared_error(model(x), y).mean().backward()
    optimizer.step()


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def test_held_bytes_of_ddp_ddlab_and_torch(comm) -> None:
    size = comm.Get_size()
    module = make_mlp(seed=1, hidden=HIDDEN)
    tensors = list(module.parameters())
    psi = sum(p.numel() for p in tensors)
    replica = DataParallel(module, comm)
    optimizer = adam(module.parameters())
    one_step(comm, replica, optimizer)
    ddp = sharded.held_bytes(replica, optimizer)
    replica.remove_hooks()

    model = sharded.Sharded(make_mlp(seed=1, hidden=HIDDEN), comm, stage=3)
    optimizer = model.attach(adam(model.shards()))
    one_step(comm, model, optimizer)
    zero3 = sharded.held_bytes(model, optimizer)
    zero3_want = sum(16 * unit.space.shard_numel + STEP for unit in model.units)  # master, grad, 2 moments
    model.close()

    init_gloo(comm)
    ddp_torch, zero = sharded.torch_zero(make_mlp(seed=1, hidden=HIDDEN), torch.optim.Adam, lr=1e-3)
    one_step(comm, ddp_torch, zero)
    owned = [p for group in zero.optim.param_groups for p in group["params"]]
    torch_zero = sharded.held_bytes(ddp_torch, zero)
    torch_zero_want = 8 * psi + sum(8 * p.numel() + STEP for p in owned)  # replicated parameters and gradients
    owned_numel = comm.allgather(sum(p.numel() for p in owned))

    fsdp = sharded.torch_fsdp(make_mlp(seed=1, hidden=HIDDEN))
    optimizer = adam(fsdp.parameters())
    one_step(comm, fsdp, optimizer)
    fsdp_held = comm.allgather(sharded.held_bytes(fsdp, optimizer))
    close_gloo()

    ok = (
        ddp == 16 * psi + STEP * len(tensors)
        and zero3 == zero3_want
        and torch_zero == torch_zero_want
        and sum(owned_numel) == psi
        and (size == 1 or max(owned_numel) > psi / size)  # whole tensors: the largest layer decides
        and 16 * psi / size <= max(fsdp_held) <= 1.2 * 16 * psi / size + STEP * len(tensors)
    )
    assert comm.allreduce(int(ok), op=MPI.MIN) == 1, (ddp, zero3, zero3_want, torch_zero, torch_zero_want, fsdp_held)
