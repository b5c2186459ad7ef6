"""torch's own sharding beside ddlab's, over gloo: ZeroRedundancyOptimizer (ZeRO-1) and FSDP2 (ZeRO-3).

Both need torch.distributed running (`ddlab.data_parallel.init_gloo(comm)`).

- `torch_zero(module, optimizer_class, **kwargs)`: torch's DDP with a `ZeroRedundancyOptimizer`.
  It partitions whole parameter tensors among the ranks (sorted greedy: the largest first, each
  to the rank holding least), not a flat buffer, so one rank may own much more than 1/P of the
  optimizer state when one layer dominates.
- `torch_fsdp(module)`: FSDP2's `fully_shard` on each child that has parameters (the units, as
  in `Sharded`), then on the root. FSDP2 shards each parameter along its first dimension (a
  DTensor) instead of flattening the unit.
- `held_bytes(model, optimizer)`: the bytes of model state one rank holds, counted the same way
  for all of them and for ddlab's trainers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..data_parallel import torch_ddp

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

# torch.distributed's FSDP, optim and tensor modules are imported where used: together they
# cost about a second of CPU, which every `import ddlab.sharded` would otherwise pay.


def torch_zero(
    module: nn.Module, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
) -> tuple[DistributedDataParallel, ZeroRedundancyOptimizer]:
    """torch's ZeRO-1: `module` in torch's DDP, and a ZeroRedundancyOptimizer of `optimizer_class` over it."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = torch_ddp(module)
    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=optimizer_class, **kwargs)


def torch_fsdp(module: nn.Module) -> nn.Module:
    """FSDP2 over every rank of torch.distributed: `fully_shard` each child with parameters, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not running: call init_gloo(comm) first")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds in the model's and the optimizer's parameters, their gradients and the optimizer's state.

    Each storage is counted once (the parameters of a ddlab unit are views of one flat buffer; a
    freed unit's storage holds nothing), a DTensor by its local piece, and a ZeroRedundancyOptimizer
    by the state of its local optimizer. Only tensors torch exposes count: torch DDP's communication
    buckets (another gradient's worth) do not."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor

    tensors: list[torch.Tensor | None] = []
    for p in [*model.parameters(), *(p for group in optimizer.param_groups for p in group["params"])]:
        tensors += [p, p.grad]
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    for state in inner.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()  # a freed storage: address 0, 0 bytes
    return sum(storages.values())
