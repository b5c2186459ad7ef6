"""Recovery by shrinking (ULFM): revoke, shrink, agree on the step, and data-parallel training that goes on.

- `recover(comm, done) -> (survivors, step)`, exercise 19.2: after a failure seen on `comm`, revoke it
  (so every rank leaves what it was waiting in), shrink it to the survivors (ranks in the old order,
  errors returned), and agree on the last step every survivor completed: the smallest `done`, the same
  on every survivor, confirmed by `Agree` so that a failure during the recovery starts it over.
- `train_resilient(comm, problem, steps) -> losses`, exercise 19.3: SGD on `problem` (a `Regression`
  or its probe), the global batch of each step split over the ranks of the communicator of the moment
  (`block_range`), losses and gradients summed by one Allreduce; each step commits only if every rank
  agrees (`Agree`) that it completed, otherwise the survivors recover and redo it with the dead rank's
  samples spread over them: the same global batch, each sample counted once, the losses equal to one
  process's. Returns the mean loss of every step, the same list on every survivor.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import numpy as np
from mpi4py import MPI

from ..runtime.blocks import block_range
from ..runtime.reference import reference
from .detector import is_failure
from .problem import Regression

T = TypeVar("T")


@reference("recover")
def recover(comm: MPI.Comm, done: int) -> tuple[MPI.Comm, int]:
    """The survivors' communicator and the step they all completed (the smallest `done`), after a failure."""
    while True:
        comm.Revoke()
        survivors = comm.Shrink()
        survivors.Set_errhandler(MPI.ERRORS_RETURN)
        # MPI's own reduction: mpi4py's object allreduce adds a Comm_dup and a Bcast, whose error after another death
        # may be of a class is_failure does not count
        ok, smallest = 1, np.array([done])
        try:
            survivors.Allreduce(MPI.IN_PLACE, smallest, op=MPI.MIN)
        except MPI.Exception as err:
            if not is_failure(err):
                raise
            ok = 0
            survivors.Revoke()  # a survivor may still wait in the allreduce for us: it fails too, and comes to Agree
        survivors.Ack_failed()  # failures known now are acknowledged: Agree answers instead of raising for them
        try:  # a death not every survivor acknowledged makes Agree raise, on every survivor alike: a no
            ok = survivors.Agree(ok)
        except MPI.Exception as err:
            if not is_failure(err):
                raise
            ok = 0
        if ok:
            return survivors, int(smallest[0])
        comm = survivors  # another rank died while we recovered: again, from the survivors


def attempt(comm: MPI.Comm, work: Callable[..., T], *args: Any) -> T | None:
    """work(*args), then Agree whether every rank of comm completed it: its result if all did, None if any failed.

    The commit of a step: a failure inside it (a peer's death, a revoked communicator) on any rank makes
    every rank answer None, so no rank goes on with a step the others will redo."""
    ok, result = 1, None
    try:
        result = work(*args)
    except MPI.Exception as err:
        if not is_failure(err):
            raise
        ok = 0
        # A rank that saw the failure gives up the step; another may be waiting for its message, from a live
        # rank, and would wait forever: revoking the communicator makes its every pending call fail too.
        comm.Revoke()
    try:
        ok = comm.Agree(ok)
    except MPI.Exception as err:
        if not is_failure(err):
            raise
        ok = 0
    return result if ok else None


def _data_parallel_step(comm: MPI.Comm, problem: Regression, params: np.ndarray, mine: np.ndarray) -> np.ndarray:
    """[summed loss, summed gradient...] over every rank's samples."""
    loss, grad = problem.loss_and_grad(params, mine)
    total = np.empty(1 + params.size)
    comm.Allreduce(np.concatenate(([loss], grad)), total)
    return total


@reference("train_resilient")
def train_resilient(comm: MPI.Comm, problem: Regression, steps: int) -> list[float]:
    """SGD for `steps` steps, data-parallel over `comm`, surviving ranks' deaths: one process's losses."""
    params, losses, step = problem.initial(), [], 0
    while step < steps:
        rank, size = comm.Get_rank(), comm.Get_size()
        span = block_range(problem.batch, rank, size)  # lab 12's plan: the global batch over today's ranks
        mine = problem.batch_ids(step)[span.start : span.stop]
        total = attempt(comm, _data_parallel_step, comm, problem, params, mine)
        if total is None:
            comm, step = recover(comm, step)
            continue
        params = params - problem.lr * total[1:] / problem.batch
        losses.append(float(total[0] / problem.batch))
        step += 1
    return losses
