"""Send and receive that autograd sees: activations travel forward, their gradients backward.

A stage's forward ends by sending its outputs; its backward must start by
receiving their gradients from the stages that used them. Written as autograd
functions, the messages become nodes of the graph: `SendTensor` returns a 0-dim
placeholder whose backward receives the gradient of what was sent, and
`RecvTensor`'s backward sends the gradient of what was received back to its sender.
A stage then runs its whole backward, messages included, with one
`torch.autograd.backward(placeholders)`.
"""

from __future__ import annotations

import torch

from ..runtime.reference import reference
from .messages import Mailbox


class SendTensor(torch.autograd.Function):
    """Forward: post x to rank `peer`, return a placeholder. Backward: receive x's gradient from `peer`."""

    @staticmethod
    @reference("send_tensor")
    def forward(ctx, x: torch.Tensor, mailbox: Mailbox, peer: int, tag: int) -> torch.Tensor:
        mailbox.post(x, peer, tag)
        ctx.mailbox, ctx.peer, ctx.tag = mailbox, peer, tag
        ctx.shape, ctx.dtype = tuple(x.shape), x.dtype
        return x.new_zeros(())

    @staticmethod
    @reference("send_tensor")
    def backward(ctx, _placeholder_grad: torch.Tensor):
        grad = ctx.mailbox.take(ctx.shape, ctx.dtype, ctx.peer, ctx.tag)
        return grad, None, None, None


class RecvTensor(torch.autograd.Function):
    """Forward: receive a tensor from rank `peer`. Backward: send its gradient back to `peer`.

    `anchor` is an empty tensor that requires grad: it ties the received tensor
    into the graph, so that autograd calls this backward.
    """

    @staticmethod
    @reference("recv_tensor")
    def forward(
        ctx, anchor: torch.Tensor, mailbox: Mailbox, peer: int, tag: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        ctx.mailbox, ctx.peer, ctx.tag = mailbox, peer, tag
        return mailbox.take(shape, dtype, peer, tag)

    @staticmethod
    @reference("recv_tensor")
    def backward(ctx, grad: torch.Tensor):
        ctx.mailbox.post(grad, ctx.peer, ctx.tag)
        return None, None, None, None, None, None


def send(
    x: torch.Tensor, mailbox: Mailbox, peer: int, tag: int, function: type[torch.autograd.Function] = SendTensor
) -> torch.Tensor:
    """Send x to peer through autograd; returns the placeholder to call backward on."""
    return function.apply(x, mailbox, peer, tag)


def recv(
    mailbox: Mailbox,
    peer: int,
    tag: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    function: type[torch.autograd.Function] = RecvTensor,
) -> torch.Tensor:
    """Receive a tensor from peer through autograd; its gradient goes back to peer in backward."""
    return function.apply(torch.empty(0, requires_grad=True), mailbox, peer, tag, tuple(shape), dtype)
