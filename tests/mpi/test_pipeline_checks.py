"""Lab 07's executor check: fails wrong executors on every rank within its timeout, passes valid ones.

Every rank runs the same tests; the check makes all ranks raise the same error.
"""

from __future__ import annotations

import functools

import ddlab.checks.pipeline as checks
import numpy as np
import pytest
import torch
from ddlab.checks import CheckFailed, check_run_schedule
from ddlab.pipeline import micro_batch_loss, run_schedule
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
run_schedule = unguarded(run_schedule)

WORLD = MPI.COMM_WORLD


def plain(comm, layers, ops, inputs, targets, bug=None):
    """A valid executor on plain point-to-point calls (Isend of NumPy arrays, Recv), or one with a bug.

    bug="irecv and wait" is a valid variant (Irecv, then Wait), not a bug.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    kept, losses, sends, order = {}, {}, [], []
    any_tag = bug == "ignores tags"

    def post(tensor, dest, tag):
        buf = tensor.detach().numpy().astype(np.float32 if bug == "float32 messages" else np.float64)
        dest = 0 if bug == "gradients to rank 0" and dest < rank else dest
        if bug == "blocking sends":
            comm.Send(buf, dest, tag)
        else:
            sends.append((comm.Isend(buf, dest, tag + (bug == "wrong tag")), buf))

    def take(source, tag):
        buf = np.empty(tuple(inputs[0].shape), np.float64)
        if bug == "irecv and wait":
            comm.Irecv(buf, source, tag).Wait()
        else:
            comm.Recv(buf, source, MPI.ANY_TAG if any_tag else tag)
        return torch.from_numpy(buf)

    for kind, i in ops:
        if kind == "F":
            if rank == 0 and bug == "scales inputs in place":
                inputs[i].mul_(2)
            x = inputs[i] if rank == 0 else take(rank - 1, i).requires_grad_()
            y = layers(x)
            if rank == size - 1:
                y = micro_batch_loss(y, targets[i])
                losses[i] = y.detach() if bug == "tensor losses" else y.item()
            else:
                post(x if bug == "sends its input" else y, rank + 1, i)
            kept[i] = (x, y)
        else:
            x, y = kept.pop(min(kept) if bug == "oldest kept first" else i)
            if bug == "overwrites gradients":
                layers.zero_grad()
            missing = bug == "no gradient receive" and rank < size - 1
            y.backward(None if rank == size - 1 else torch.zeros_like(y) if missing else take(rank + 1, i))
            if rank > 0:
                post(x.grad, rank - 1, i)
            order.append(i)
    if bug != "never waits for its sends":
        MPI.Request.Waitall([r for r, _ in sends])
    if bug == "None on the first ranks" and rank < size - 1:
        return None
    return [losses[i] for i in (order if bug == "losses in backward order" else sorted(losses))]


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setattr(checks, "TIMEOUT", 5.0)


@pytest.mark.parametrize(
    "fn",
    [run_schedule, plain, functools.partial(plain, bug="irecv and wait")],
    ids=["library", "plain point-to-point", "Irecv and Wait"],
)
def test_valid_executors_pass(fn, capsys):
    check_run_schedule(fn)
    assert WORLD.Get_rank() or "passed: run_schedule" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bug, expected",
    [
        ("sends its input", "wrong values"),
        ("overwrites gradients", "wrong values"),
        ("ignores tags", "wrong values"),
        ("oldest kept first", "wrong values"),
        ("scales inputs in place", "changed in place"),
        ("float32 messages", "wrong values"),
        ("no gradient receive", "wrong values"),  # the unreceived sends are small enough to complete anyway
        ("losses in backward order", "wrong losses"),  # caught by the mixed order's newest-first backwards
        ("tensor losses", "wrong losses"),
        ("None on the first ranks", "wrong losses"),
        ("never waits for its sends", "Mailbox.free"),
    ],
)
def test_wrong_executors_fail_on_every_rank(bug, expected):
    with pytest.raises(CheckFailed, match=expected):
        check_run_schedule(functools.partial(plain, bug=bug))


@pytest.mark.parametrize("bug", ["blocking sends", "wrong tag", "gradients to rank 0"])
def test_executors_that_never_finish_fail_within_the_timeout(bug, monkeypatch):
    """A deadlock, a message nobody receives or a receive nobody matches: the deadlock hint, not a hang."""
    monkeypatch.setattr(checks, "TIMEOUT", 2.0)
    with pytest.raises(CheckFailed, match="Stalled(.|\n)*blocking send waits for its receiver"):
        check_run_schedule(functools.partial(plain, bug=bug))


def test_an_error_of_the_students_own_gets_no_deadlock_advice():
    def forgets_requires_grad(comm, layers, ops, inputs, targets):
        raise AttributeError("'NoneType' object has no attribute 'detach'")

    with pytest.raises(CheckFailed) as info:
        check_run_schedule(forgets_requires_grad)
    assert "AttributeError" in str(info.value) and "blocking send" not in str(info.value)


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


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("run_schedule", "ddlab.pipeline.run_schedule", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
