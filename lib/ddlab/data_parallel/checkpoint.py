"""Checkpoints of data-parallel training: rank 0 writes, every rank resumes.

All replicas hold the same parameters and optimizer state, so one copy is enough:
rank 0 writes it (to a temporary file renamed into place, so a crash mid-write
never leaves half a checkpoint). To resume, rank 0 reads it and broadcasts it, so
the other ranks need not see the same file system (compute nodes often do not
share /tmp). The sampler needs no state: an epoch's shards follow from (seed, epoch).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI
from torch import nn


def _inner(model: nn.Module) -> nn.Module:
    """The wrapped module of DataParallel / DistributedDataParallel, so checkpoints fit both."""
    return getattr(model, "module", model)


def save_checkpoint(
    path: str | Path, comm: MPI.Comm, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **state: Any
) -> None:
    """Rank 0 writes model and optimizer state plus `state` (epoch, step...); all ranks return after."""
    problem = None
    if comm.Get_rank() == 0:
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            payload = {
                "model": _inner(model).state_dict(),
                "state": state,
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
            }
            partial = path.with_name(path.name + ".partial")
            torch.save(payload, partial)
            os.replace(partial, path)
        except OSError as err:
            problem = f"rank 0 could not write the checkpoint {path}: {err}"
    problem = comm.bcast(problem, root=0)
    if problem:
        raise OSError(problem)


def load_checkpoint(
    path: str | Path, comm: MPI.Comm, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Rank 0 reads the checkpoint and broadcasts it; every rank loads it; returns the saved `state`."""
    payload, problem = None, None
    if comm.Get_rank() == 0:
        try:
            payload = torch.load(Path(path), weights_only=True)
        except (OSError, RuntimeError) as err:
            problem = f"rank 0 could not read the checkpoint {path}: {err}"
    payload, problem = comm.bcast((payload, problem), root=0)
    if problem:
        raise OSError(problem)
    _inner(model).load_state_dict(payload["model"])
    if optimizer is not None and payload["optimizer"] is not None:
        optimizer.load_state_dict(payload["optimizer"])
    return payload["state"]
