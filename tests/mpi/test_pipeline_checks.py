"""Lab 07's executor check: fails wrong executors on every rank within its timeout, passes valid ones.

Every rank runs the same tests; the check makes all ranks raise the same error.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from mpi4py import MPI

import ddlab.checks.pipeline as checks
from ddlab.checks import CheckFailed, check_run_schedule
from ddlab.pipeline import micro_batch_loss, run_schedule

WORLD = MPI.COMM_WORLD


def plain(comm, layers, ops, inputs, targets, bug=None):
    """A valid executor on plain point-to-point calls (Isend of NumPy arrays, Recv), or one with a bug."""
    rank, size = comm.Get_rank(), comm.Get_size()
    kept, losses, sends = {}, {}, []
    any_tag = bug == "ignores tags"

    def post(tensor, dest, tag):
        buf = tensor.detach().numpy().copy()
        if bug == "blocking sends":
            comm.Send(buf, dest, tag)
        else:
            sends.append((comm.Isend(buf, dest, tag), buf))

    def take(source, tag):
        buf = np.empty(tuple(inputs[0].shape), np.float64)
        comm.Recv(buf, source, MPI.ANY_TAG if any_tag else tag)
        return torch.from_numpy(buf)

    for kind, i in ops:
        if kind == "F":
            x = inputs[i] if rank == 0 else take(rank - 1, i).requires_grad_()
            y = layers(x)
            if rank == size - 1:
                y = micro_batch_loss(y, targets[i])
                losses[i] = y.item()
            else:
                post(x if bug == "sends its input" else y, rank + 1, i)
            kept[i] = (x, y)
        else:
            x, y = kept.pop(min(kept) if bug == "oldest kept first" else i)
            if bug == "overwrites gradients":
                layers.zero_grad()
            y.backward(None if rank == size - 1 else take(rank + 1, i))
            if rank > 0:
                post(x.grad, rank - 1, i)
    MPI.Request.Waitall([r for r, _ in sends])
    return [losses[i] for i in sorted(losses)]


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setattr(checks, "TIMEOUT", 5.0)


@pytest.mark.parametrize("fn", [run_schedule, plain], ids=["library", "plain point-to-point"])
def test_valid_executors_pass(fn, capsys):
    check_run_schedule(fn)
    assert WORLD.Get_rank() or "passed: run_schedule" in capsys.readouterr().out


@pytest.mark.parametrize("bug, expected", [
    ("sends its input", "wrong values"),
    ("overwrites gradients", "wrong values"),
    ("ignores tags", "wrong values"),
    ("oldest kept first", "wrong values"),
    ("blocking sends", "Isend"),
])
def test_wrong_executors_fail_on_every_rank(bug, expected):
    with pytest.raises(CheckFailed, match=expected):
        check_run_schedule(functools.partial(plain, bug=bug))


def test_extra_messages_are_counted():
    def twice(comm, layers, ops, inputs, targets):
        losses = run_schedule(comm, layers, ops, inputs, targets)
        if comm.Get_rank() + 1 < comm.Get_size():
            comm.Send(np.zeros(1), comm.Get_rank() + 1, 99)
        if comm.Get_rank() > 0:
            comm.Recv(np.zeros(1), comm.Get_rank() - 1, 99)
        return losses
    with pytest.raises(CheckFailed, match="wrong messages"):
        check_run_schedule(twice)


def test_stub_error_passes_through():
    def stub(comm, layers, ops, inputs, targets):
        raise NotImplementedError("Exercise 7.3 (run_schedule) is not done yet")
    with pytest.raises(NotImplementedError, match="7.3"):
        check_run_schedule(stub)
