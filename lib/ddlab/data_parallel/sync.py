"""Keep the replicas in step: broadcast the parameters once, average the gradients every step.

Data parallelism keeps one copy of the model per rank. The copies stay equal only if
they start equal (broadcast rank 0's parameters and buffers) and take equal steps
(every rank applies the gradient averaged over all ranks). The allreduce that sums
the gradients is pluggable: any function with lab 03's signature
`allreduce(comm, x: 1-D array) -> new array of the sums` works, so the ring a
student wrote can train a network.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from ..allreduce import ALGORITHMS, Allreduce, allreduce_mpi
from ..runtime.comm import Comm
from ..runtime.reference import reference

#: What callers may pass as an allreduce: None or "mpi" (the MPI library's),
#: a name of lab 03's algorithms ("ring", "tree", ...), or a function.
AllreduceChoice = None | str | Allreduce


def resolve_allreduce(choice: AllreduceChoice) -> Allreduce:
    """The allreduce function for `choice` (lab 03's versions are looked up by name)."""
    if choice is None or choice == "mpi":
        return allreduce_mpi
    if isinstance(choice, str):
        algorithms: dict[str, Allreduce] = dict(ALGORITHMS)
        if choice not in algorithms:
            raise ValueError(
                f"no allreduce called {choice!r}: use 'mpi', one of {sorted(algorithms)}, "
                "or pass a function f(comm, x) -> new array"
            )
        return algorithms[choice]
    if not callable(choice):
        raise TypeError(f"allreduce must be None, a name or a function f(comm, x), got {type(choice).__name__}")
    return choice


def model_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters then buffers (BatchNorm's running statistics...): the state replicas share."""
    return [*module.parameters(), *module.buffers()]


def _by_dtype(tensors: Iterable[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return groups


@reference("broadcast_parameters")
def broadcast_parameters(module: nn.Module, comm: MPI.Comm, root: int = 0) -> None:
    """Overwrite every rank's parameters and buffers, in place, with root's: one Bcast per dtype."""
    with torch.no_grad():
        for tensors in _by_dtype(model_tensors(module)).values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()
            comm.Bcast(flat, root=root)
            _scatter_back(torch.from_numpy(flat), tensors)


def _scatter_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of `flat` into `tensors`."""
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


@reference("average_gradients")
def average_gradients(module: nn.Module, comm: Comm, allreduce: AllreduceChoice = None) -> None:
    """Replace each gradient by its mean over ranks: all gradients flattened, one allreduce per dtype.

    A parameter without a gradient on this rank counts as a zero gradient (and gets one).
    """
    reduce = resolve_allreduce(allreduce)
    size = comm.Get_size()
    params = [p for p in module.parameters() if p.requires_grad]
    with torch.no_grad():
        for group in _by_dtype(params).values():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group])
            total = torch.from_numpy(np.asarray(reduce(comm, flat.numpy())))
            grads = []
            for p in group:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            _scatter_back(total / size, grads)


def replicas_differ(module: nn.Module, comm: MPI.Comm) -> float:
    """Largest relative difference between this rank's parameters and rank 0's, max over ranks."""
    mine = torch.cat([t.detach().reshape(-1).double() for t in model_tensors(module)]).numpy()
    theirs = mine.copy()
    comm.Bcast(theirs, root=0)
    scale = max(float(np.max(np.abs(theirs), initial=0.0)), 1e-300)
    return comm.allreduce(float(np.max(np.abs(mine - theirs), initial=0.0)) / scale, op=MPI.MAX)
