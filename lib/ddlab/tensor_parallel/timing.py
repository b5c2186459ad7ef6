"""Step times of lab 14's ways of splitting a GPT, side by side, and PyTorch's own tensor parallelism on it.

- `step_seconds(comm, step, steps)`: the median over `steps` training steps (after one warm-up) of the
  slowest rank's time, with a barrier after each step; a rank that is not `active` only waits
  (one process's run on rank 0 alone).
- `torch_parallelize(model, comm)`: the same GPT under PyTorch's `parallelize_module` (ColwiseParallel
  for q/k/v and the MLP's first layer, RowwiseParallel for the projections, the rest replicated) over a
  gloo DeviceMesh of comm's ranks; q/k/v rows reordered so that each rank's contiguous shard holds its
  heads' q, k and v, and each attention told its heads (`attn.heads`). Needs torch.distributed over gloo (`ddlab.data_parallel.init_gloo`, called here);
  `ddlab.data_parallel.close_gloo` ends it.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, cast

import torch
from mpi4py import MPI
from torch import nn

from ..models.gpt import GPT, Block
from .block import qkv_rows


def step_seconds(comm: MPI.Comm, step: Callable[[int], None], steps: int, active: bool = True) -> float:
    """Median seconds per step over `steps` steps after one warm-up step, the slowest rank's (barriers)."""
    times = []
    if active:
        step(-1)
    comm.Barrier()
    for i in range(steps):
        start = time.perf_counter()
        if active:
            step(i)
        comm.Barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_parallelize(model: GPT, comm: MPI.Comm) -> nn.Module:
    """model (changed in place, dropout off) under PyTorch's parallelize_module over gloo on comm's ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ..data_parallel import init_gloo

    size, config = comm.Get_size(), model.config
    if config.dropout > 0 or config.n_head % size:
        raise ValueError("PyTorch's split here needs dropout=0.0 and n_head a multiple of the rank count")
    init_gloo(comm)
    per = config.n_head // size
    order = torch.cat([qkv_rows(config.n_embd, config.n_head, range(r * per, (r + 1) * per)) for r in range(size)])
    plan: dict[str, ColwiseParallel | RowwiseParallel] = {}
    for i, block in enumerate(cast(list[Block], list(model.blocks))):
        attn = block.attn
        with torch.no_grad():
            attn.qkv.weight.copy_(attn.qkv.weight[order].clone())
            attn.qkv.bias.copy_(attn.qkv.bias[order].clone())
        attn.heads = range(comm.Get_rank() * per, (comm.Get_rank() + 1) * per)  # its shard's heads
        for name, style in (("attn.qkv", ColwiseParallel), ("attn.proj", RowwiseParallel)):
            plan[f"blocks.{i}.{name}"] = style()
        for name, style in (("mlp.fc", ColwiseParallel), ("mlp.proj", RowwiseParallel)):
            plan[f"blocks.{i}.{name}"] = style()
    return parallelize_module(model, init_device_mesh("cpu", (size,)), plan)  # type: ignore[arg-type]
