"""ddlab.sharded.ShardedOptimizer (ZeRO-1 around any torch optimizer, lab 13's exercise 13.3 reference):
equal to one process on the global batch, in float64 to 1e-10, with 1/P of the optimizer state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab import sharded
from ddlab.data import StressStrainCurves
from ddlab.data_parallel import squared_error
from ddlab.models import make_mlp
from ddlab.runtime.comm import first_ranks
from mpi4py import MPI

TOLERANCE = 1e-10
PER_RANK, STEPS = 5, 3
HIDDEN = (48, 32, 17)
OPTIMIZERS = {
    "SGD with momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-3}),
}


def batches(size: int, rank: int | None):
    data = StressStrainCurves(n=size * PER_RANK * STEPS, seed=4, dtype=torch.float64)
    for step in range(STEPS):
        first = step * size * PER_RANK + (0 if rank is None else rank * PER_RANK)
        yield data[np.arange(first, first + (size if rank is None else 1) * PER_RANK)]


def state_items(optimizer: torch.optim.Optimizer) -> int:
    """Items of the optimizer's state tensors (the step counters, 0-dimensional, left out)."""
    return sum(t.numel() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())


@pytest.mark.parametrize("collectives", ["mpi", "ring"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_optimizer_matches_one_process_with_a_pth_of_the_state(comm, name, collectives):
    optimizer_class, kwargs = OPTIMIZERS[name]
    results = []
    for ranks in range(1, comm.Get_size() + 1):
        sub = first_ranks(comm, ranks)
        error, ratio_ok = 0.0, True
        if sub is not None:
            size = sub.Get_size()
            reference = make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN)
            plain = optimizer_class(reference.parameters(), **kwargs)
            for x, y in batches(size, None):
                plain.zero_grad()
                squared_error(reference(x), y).mean().backward()
                plain.step()
            model = make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN)
            optimizer = sharded.ShardedOptimizer(
                model.parameters(), optimizer_class, sub, collectives=collectives, **kwargs
            )
            for x, y in batches(size, sub.Get_rank()):
                optimizer.zero_grad()
                squared_error(model(x), y).mean().backward()
                optimizer.step()
            error = max(
                float((p - q).abs().max() / q.abs().max()) for p, q in zip(model.parameters(), reference.parameters())
            )
            numel = sum(p.numel() for p in model.parameters())
            per_item = state_items(plain) // numel  # 1 for SGD's momentum, 2 for Adam's moments
            ratio_ok = per_item >= 1 and state_items(optimizer.optimizer) == per_item * -(-numel // size)
            sub.Free()
        results.append((ranks, comm.allreduce(error, op=MPI.MAX), comm.allreduce(ratio_ok, op=MPI.LAND)))
    assert all(error < TOLERANCE and ok for _, error, ok in results), results
