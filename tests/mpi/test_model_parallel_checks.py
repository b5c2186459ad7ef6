"""Lab 06's autograd checks catch wrong send/receive functions, on every rank, without hanging.

Every rank runs the same tests; the checks make all ranks raise the same error.
"""

from __future__ import annotations

import ddlab.checks.model_parallel as checks
import pytest
import torch
from ddlab.checks import CheckFailed, check_recv_tensor, check_send_tensor
from ddlab.model_parallel import RecvTensor, SendTensor
from ddlab.runtime.reference import unguarded

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
RecvTensor = unguarded(RecvTensor)
SendTensor = unguarded(SendTensor)


class SendKeepsGradient(SendTensor):
    """Receives the gradient but does not pass it on: earlier stages get no gradients."""

    @staticmethod
    def backward(ctx, _):
        ctx.mailbox.take(ctx.shape, ctx.dtype, ctx.peer, ctx.tag)
        return None, None, None, None


class SendNeverReceives(SendTensor):
    """Makes up a zero gradient instead of receiving it: wrong gradients, one message short."""

    @staticmethod
    def backward(ctx, _):
        return torch.zeros(ctx.shape, dtype=ctx.dtype), None, None, None


class SendTwice(SendTensor):
    """Posts every activation twice."""

    @staticmethod
    def forward(ctx, x, mailbox, peer, tag):
        mailbox.post(x, peer, tag + 1000)
        return SendTensor.forward(ctx, x, mailbox, peer, tag)


class SendWrongTag(SendTensor):
    """Waits for the gradient under another tag than the activation went with: nobody sends it."""

    @staticmethod
    def backward(ctx, _):
        return ctx.mailbox.take(ctx.shape, ctx.dtype, ctx.peer, ctx.tag + 1), None, None, None


class SendPlaceholderShape(SendTensor):
    """Receives the gradient into the placeholder gradient's shape (0-dim) instead of x's saved shape."""

    @staticmethod
    def backward(ctx, placeholder_grad):
        grad = ctx.mailbox.take(tuple(placeholder_grad.shape), placeholder_grad.dtype, ctx.peer, ctx.tag)
        return grad, None, None, None


class SendStub(SendTensor):
    @staticmethod
    def forward(ctx, x, mailbox, peer, tag):
        raise NotImplementedError("Exercise 6.1 (SendTensor) is not done yet: write it where this line is.")


class RecvSendsNothingBack(RecvTensor):
    """Never sends the gradient back: the sender waits for it until the timeout."""

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None, None, None


class RecvSendsDoubleGradient(RecvTensor):
    @staticmethod
    def backward(ctx, grad):
        ctx.mailbox.post(2 * grad, ctx.peer, ctx.tag)
        return None, None, None, None, None, None


class RecvSendsToNextRank(RecvTensor):
    """Sends the gradient to the rank after the sender: its sender waits, another rank gets a stray message."""

    @staticmethod
    def backward(ctx, grad):
        ctx.mailbox.post(grad, (ctx.peer + 1) % ctx.mailbox.size, ctx.tag)
        return None, None, None, None, None, None


class RecvSendsFloat32(RecvTensor):
    """Sends the gradient in float32 while the model is float64: half the bytes."""

    @staticmethod
    def backward(ctx, grad):
        ctx.mailbox.post(grad.float(), ctx.peer, ctx.tag)
        return None, None, None, None, None, None


def test_reference_functions_pass():
    check_send_tensor(SendTensor)
    check_recv_tensor(RecvTensor)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (SendKeepsGradient, "are missing. Check that SendTensor.backward returns the gradient"),
        (SendNeverReceives, "differ from one process"),
        (SendTwice, "activations sent forward: .*Check that SendTensor.forward posts each activation once"),
    ],
)
def test_wrong_send_fails(wrong, says):
    with pytest.raises(CheckFailed, match=says):
        check_send_tensor(wrong)


def test_wrong_recv_fails(monkeypatch):
    with pytest.raises(CheckFailed, match="differ from one process"):
        check_recv_tensor(RecvSendsDoubleGradient)
    with pytest.raises(CheckFailed, match="gradients sent backward: .*in the dtype it came in"):
        check_recv_tensor(RecvSendsFloat32)
    monkeypatch.setattr(checks, "TIMEOUT", 2.0)
    for wrong in (RecvSendsNothingBack, RecvSendsToNextRank):
        with pytest.raises(CheckFailed, match="Stalled.*deadlock"):
            check_recv_tensor(wrong)


def test_wrong_tag_fails_within_the_timeout(monkeypatch):
    monkeypatch.setattr(checks, "TIMEOUT", 2.0)
    with pytest.raises(CheckFailed, match="Stalled.*deadlock"):
        check_send_tensor(SendWrongTag)


def test_receiving_into_the_placeholder_shape_fails_within_the_timeout(monkeypatch):
    monkeypatch.setattr(checks, "TIMEOUT", 2.0)
    with pytest.raises(CheckFailed, match="expected a \\(\\) tensor .*holds .* bytes.*placeholder"):
        check_send_tensor(SendPlaceholderShape)
    check_send_tensor(SendTensor)  # and the ranks are still in step afterwards


def test_stub_raises_not_implemented_on_every_rank():
    with pytest.raises(NotImplementedError, match="Exercise 6.1"):
        check_send_tensor(SendStub)
    check_send_tensor(SendTensor)  # and the ranks are still in step afterwards


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("send_tensor", "ddlab.model_parallel.SendTensor", ()),
        ("recv_tensor", "ddlab.model_parallel.RecvTensor", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
