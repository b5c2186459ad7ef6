"""ddlab.sharded under a memory budget that one rank alone runs out of, mid-step.

The rank that passes its budget must not leave the others waiting for collectives it never
starts, nor free its communicator with requests in flight (that crashed Open MPI inside
`NBC_Progress`): every rank raises the same error, then the model closes and the next
collective and a fresh model work. A rank that hangs is stopped by the test's timeout.
"""

from __future__ import annotations

import pytest
import torch
from ddlab import sharded
from ddlab.data_parallel import squared_error
from ddlab.models import make_mlp
from ddlab.runtime.memory import Ledger, OutOfMemory
from mpi4py import MPI

HIDDEN = (48, 32, 17)
PHASES = ("forward", "backward", "step")


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return (
        torch.randn(3, 600, generator=generator, dtype=torch.float64),
        torch.randn(3, 2, generator=generator, dtype=torch.float64),
    )


def one_step(model: sharded.Sharded, optimizer: torch.optim.Optimizer, ledger: Ledger, short: bool, phase: str) -> None:
    """A step in which, if `short`, the ledger's budget runs out in `phase` (only what it has left plus 1 byte)."""

    def tighten(now: str) -> None:
        if short and phase == now:
            ledger.budget = ledger.total + 1

    x, y = batch(model.rank)
    optimizer.zero_grad()
    tighten("forward")
    with ledger.activations():
        prediction = model(x)
    tighten("backward")
    squared_error(prediction, y).mean().backward()
    tighten("step")
    optimizer.step()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("options", [{"stage": 1}, {"stage": 2}, {"stage": 3}, {"stage": 3, "prefetch": 1}], ids=str)
def test_one_rank_out_of_memory_mid_step_is_an_error_on_every_rank(comm, phase, options):
    size, rank = comm.Get_size(), comm.Get_rank()
    victim = 1 % size
    ledger = Ledger()
    model = sharded.Sharded(make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN), comm, ledger=ledger, **options)
    optimizer = model.attach(torch.optim.Adam(model.shards(), lr=1e-2))
    if (
        phase != "step"
    ):  # a step that fits first, leaving collectives in flight (the optimizer's state grows only in the first)
        one_step(model, optimizer, ledger, short=False, phase=phase)
    error: BaseException | None = None
    try:
        one_step(model, optimizer, ledger, short=rank == victim, phase=phase)
    except OutOfMemory as err:
        error = err
    model.close()  # no collective left in flight: freeing the communicator is safe

    agreed = error is not None and getattr(error, "failures", {}).keys() == {victim}  # AgreedOutOfMemory
    message = str(error)
    said = f"out of memory on rank {victim} of {size}" in message and "budget" in message and "smaller" in message
    assert comm.allreduce(int(agreed and said), op=MPI.MIN) == 1, f"rank {rank} raised {error!r}"

    ledger = Ledger()
    fresh = sharded.Sharded(make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN), comm, ledger=ledger, **options)
    again = fresh.attach(torch.optim.Adam(fresh.shards(), lr=1e-2))
    one_step(fresh, again, ledger, short=False, phase=phase)
    parameters = fresh.full_parameters()
    fresh.close()
    first = comm.bcast(parameters, root=0)
    assert comm.allreduce(all(torch.equal(first[k], v) for k, v in parameters.items()), op=MPI.LAND)
