"""Checks for lab 14: the conjugate pair, the column- and row-parallel layers, the vocabulary-parallel loss.

Each check runs the student's code on the first P ranks for P = 1 .. world size through
a counting communicator (no MPI collective allowed: the lab's `ddlab.tensor_parallel.allreduce`
and `allgather` are the ring's point-to-point halves, so every byte is counted) and
compares with one process in float64 (1e-10): outputs, the input's gradient, and the
bytes each rank sends forward and backward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from mpi4py import MPI

from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from ..runtime.counting import CountingComm
from ..tensor_parallel.formulas import ring_bytes
from ._core import each_size, passed, run_counted

TOL = 1e-10
TIMEOUT = 20.0
SHAPE = (3, 5, 4)


def _error(got: Any, want: torch.Tensor) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"is a {type(got).__name__}, not a tensor"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"has shape {tuple(got.shape)} and dtype {got.dtype}, expected {tuple(want.shape)} and {want.dtype}"
    worst = float((got.detach() - want).abs().max()) if want.numel() else 0.0
    return None if worst < TOL else f"differs from one process's by up to {worst:.3g}"


def _conjugate_case(counting: CountingComm, fn: type[torch.autograd.Function], replicated: bool) -> tuple:
    """x through fn forward and backward on this rank; the output, x's gradient, bytes sent each way."""
    rank = counting.Get_rank()
    values = torch.arange(60, dtype=torch.float64).reshape(SHAPE) / 7
    x = (values if replicated else values * (rank + 1)).clone().requires_grad_()
    y = fn.apply(x, counting)
    forward = counting.traffic.bytes_sent
    y.backward(torch.cos(values) * (rank + 2))
    return y.detach(), x.grad, forward, counting.traffic.bytes_sent - forward


def _check_conjugate(sub: MPI.Comm, fn: type[torch.autograd.Function], name: str) -> str | None:
    size = sub.Get_size()
    copy = name == "Copy"
    (y, grad, forward, backward), _ = run_counted(
        sub, lambda c: _conjugate_case(c, fn, copy), (), name, timeout=TIMEOUT
    )
    values = torch.arange(60, dtype=torch.float64).reshape(SHAPE) / 7
    ranks = torch.arange(1, size + 1, dtype=torch.float64)
    total_grad = torch.cos(values) * float((ranks + 1).sum())
    rank = sub.Get_rank()
    want_y = values if copy else values * float(ranks.sum())
    want_grad = total_grad if copy else torch.cos(values) * (rank + 2)
    allreduce_bytes = 2 * ring_bytes(values.numel(), size, 8)
    want_bytes = (0.0, allreduce_bytes) if copy else (allreduce_bytes, 0.0)
    what = (
        "forward must return x's values; backward must return the gradient summed over the ranks"
        if copy
        else "forward must return x summed over the ranks; backward must return the gradient unchanged"
    )
    for label, got, want in (("the output", y, want_y), ("x's gradient", grad, want_grad)):
        problem = _error(got, want)
        if problem:
            return f"{name}: {label} {problem}. {name}'s {what}."
    if (forward, backward) != want_bytes:
        return (
            f"{name} sent {forward:.0f} bytes forward and {backward:.0f} backward; expected "
            f"{want_bytes[0]:.0f} and {want_bytes[1]:.0f} (one allreduce of x's {values.numel()} float64 "
            f"values {'backward' if copy else 'forward'}, by ddlab.tensor_parallel.allreduce, nothing else)"
        )
    return None


def check_conjugates(copy: type[torch.autograd.Function], reduce: type[torch.autograd.Function]) -> None:
    """copy, reduce: autograd Functions like ddlab.tensor_parallel.Copy (f) and Reduce (g), apply(x, comm)."""
    world = MPI.COMM_WORLD
    for fn, name in ((copy, "Copy"), (reduce, "Reduce")):

        def body(sub: MPI.Comm, fn: type[torch.autograd.Function] = fn, name: str = name) -> str | None:
            return _check_conjugate(sub, fn, name)

        each_size(world, body, f"{name} ({getattr(fn, '__name__', fn)}) is wrong")
    passed(
        world,
        "Copy and Reduce: values and gradients equal one process's; one allreduce each, Copy's "
        "backward, Reduce's forward",
    )


#: Positions and vocabulary of the cross-entropy check: V/t columns per rank well above the 4 values per
#: position a loss that never gathers the logits needs to send.
N, VOCAB = 30, 64


def _cross_entropy_case(counting: CountingComm, fn: Callable[..., Any]) -> tuple:
    generator = torch.Generator().manual_seed(14)
    logits = torch.randn(N, VOCAB, dtype=torch.float64, generator=generator) * 4
    targets = torch.randint(0, VOCAB, (N,), generator=generator)
    vocab = block_range(VOCAB, counting.Get_rank(), counting.Get_size())
    mine = logits[:, vocab.start : vocab.stop].clone().requires_grad_()
    loss = fn(mine, targets, counting, vocab.start)
    if not isinstance(loss, torch.Tensor) or loss.shape != ():
        raise TypeError(
            f"the loss must be a 0-dim tensor, got {type(loss).__name__} "
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
        )
    (loss * 3).backward()
    return loss.detach(), mine.grad


def check_vocab_parallel_cross_entropy(fn: Callable[[torch.Tensor, torch.Tensor, Comm, int], torch.Tensor]) -> None:
    """fn(logits (N, V_r), targets (N,), comm, start) -> the mean cross-entropy, as
    ddlab.tensor_parallel.vocab_parallel_cross_entropy; at most 4 (t-1) values per position sent per rank."""
    world = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        size = sub.Get_size()
        (loss, grad), traffic = run_counted(
            sub, lambda c: _cross_entropy_case(c, fn), (), "vocab_parallel_cross_entropy", timeout=TIMEOUT
        )
        generator = torch.Generator().manual_seed(14)
        logits = (torch.randn(N, VOCAB, dtype=torch.float64, generator=generator) * 4).requires_grad_()
        targets = torch.randint(0, VOCAB, (N,), generator=generator)
        want = F.cross_entropy(logits, targets)
        (want * 3).backward()
        assert logits.grad is not None
        vocab = block_range(VOCAB, sub.Get_rank(), size)
        for label, got, expected in (
            ("the loss", loss, want.detach()),
            ("the gradient of this rank's logits", grad, logits.grad[:, vocab.start : vocab.stop]),
        ):
            problem = _error(got, expected)
            if problem:
                return f"{label} {problem}"
        limit = 4 * (size - 1) * N * 8
        sent = traffic[sub.Get_rank()].bytes_sent
        if sent > limit:
            return (
                f"sent {sent} bytes for {N} positions over {size} ranks; a loss that never gathers the logits "
                f"needs at most {limit} (4 (t-1) float64 values per position: the maxima, the sums of "
                f"exponentials, the target's logit), whatever the vocabulary"
            )
        return None

    each_size(world, body, "vocab_parallel_cross_entropy is wrong")
    passed(world, "vocab_parallel_cross_entropy: loss and gradients equal one process's, logits never gathered")


#: The MLP of the linear-layer check: (batch, sequence, width) in, `HIDDEN` features split over the ranks.
BATCH, LENGTH, WIDTH, HIDDEN = 2, 5, 6, 12


def _mlp_case(
    counting: CountingComm,
    column: Callable[..., Any],
    row: Callable[..., Any],
    first: torch.nn.Linear,
    second: torch.nn.Linear,
    x: torch.Tensor,
    g: torch.Tensor,
) -> tuple:
    features = block_range(HIDDEN, counting.Get_rank(), counting.Get_size())
    cut = slice(features.start, features.stop)
    w1 = first.weight.detach()[cut].clone().requires_grad_()
    b1 = first.bias.detach()[cut].clone().requires_grad_()
    w2 = second.weight.detach()[:, cut].clone().requires_grad_()
    b2 = second.bias.detach().clone().requires_grad_()
    mine = x.detach().clone().requires_grad_()
    y = row(F.gelu(column(mine, w1, b1, counting)), w2, b2, counting)
    forward = counting.traffic.bytes_sent
    y.backward(g)
    return y.detach(), mine.grad, [w1.grad, b1.grad, w2.grad, b2.grad], forward, counting.traffic.bytes_sent - forward


def check_parallel_linear(column: Callable[..., Any], row: Callable[..., Any]) -> None:
    """column(x, weight, bias, comm), row(x, weight, bias, comm): as ddlab.tensor_parallel.column_parallel_linear
    and row_parallel_linear, checked as the two layers of an MLP (column, GELU, row)."""
    world = MPI.COMM_WORLD
    generator = torch.Generator().manual_seed(2)
    first, second = torch.nn.Linear(WIDTH, HIDDEN).double(), torch.nn.Linear(HIDDEN, WIDTH).double()
    with torch.no_grad():
        for p in (*first.parameters(), *second.parameters()):
            p.copy_(torch.randn(p.shape, dtype=torch.float64, generator=generator))
    x = torch.randn(BATCH, LENGTH, WIDTH, dtype=torch.float64, generator=generator, requires_grad=True)
    g = torch.randn(BATCH, LENGTH, WIDTH, dtype=torch.float64, generator=generator)
    y = second(F.gelu(first(x)))
    y.backward(g)

    def body(sub: MPI.Comm) -> str | None:
        size = sub.Get_size()
        (out, grad_x, grads, forward, backward), _ = run_counted(
            sub, lambda c: _mlp_case(c, column, row, first, second, x, g), (), "the parallel MLP", timeout=TIMEOUT
        )
        cut = block_range(HIDDEN, sub.Get_rank(), size)
        assert first.weight.grad is not None and first.bias.grad is not None
        assert second.weight.grad is not None and second.bias.grad is not None
        wants = [
            ("the output (row's)", out, y.detach(), "row must sum the ranks' parts and then add the bias, once"),
            ("the input's gradient", grad_x, x.grad, "column's backward must sum the input's gradient over ranks"),
            ("column's weight gradient", grads[0], first.weight.grad[cut.start : cut.stop], ""),
            ("column's bias gradient", grads[1], first.bias.grad[cut.start : cut.stop], ""),
            ("row's weight gradient", grads[2], second.weight.grad[:, cut.start : cut.stop], ""),
            ("row's bias gradient", grads[3], second.bias.grad, ""),
        ]
        for label, got, want, hint in wants:
            problem = _error(got, want)
            if problem:
                return f"{label} {problem}" + (f": {hint}" if hint else "")
        one = 2 * ring_bytes(BATCH * LENGTH * WIDTH, size, 8)
        if (forward, backward) != (one, one):
            return (
                f"sent {forward:.0f} bytes forward and {backward:.0f} backward; expected {one:.0f} each: one "
                f"allreduce of the output forward (in row) and one of the input's gradient backward (in column)"
            )
        return None

    each_size(world, body, "the column- and row-parallel layers are wrong")
    passed(
        world,
        "column_parallel_linear and row_parallel_linear: the split MLP equals one process's, one "
        "allreduce forward and one backward",
    )
