"""Checks for lab 14: the conjugate pair, the column- and row-parallel layers, attention split by heads,
the vocabulary-parallel loss, the sequence-parallel block.

Each check runs the student's code on the first P ranks for P = 1 .. world size through
a counting communicator (no MPI collective allowed: the lab's `ddlab.tensor_parallel.allreduce`
and `allgather` are the ring's point-to-point halves, so every byte is counted) and
compares with one process in float64 (1e-10): outputs, the input's gradient, the weights'
gradients, and the bytes sent forward and backward.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, cast

import torch
import torch.nn.functional as F
from mpi4py import MPI

from ..models.gpt import Block, CausalSelfAttention, GPTConfig, make_gpt
from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from ..runtime.counting import CountingComm
from ..tensor_parallel.block import BlockParts, qkv_rows
from ..tensor_parallel.formulas import ring_bytes
from ._core import each_size, passed, run_counted

TOL = 1e-10
TIMEOUT = 20.0
SHAPE = (3, 5, 4)

#: Appended when fewer bytes went through the communicator passed in than the exercise must send.
GLOBAL_COMM = (
    " Fewer bytes than owed went through the communicator passed in: does the code use the notebook's "
    "global communicator (`comm`, MPI.COMM_WORLD) instead of the one it was given (keep it in ctx for "
    "backward)? On fewer ranks a global communicator waits for ranks that are not there."
)


def _sizes(world: MPI.Comm) -> list[int]:
    """The world's size first (see each_size): an answer on the notebook's global communicator completes there,
    where its missing bytes show, and fails before a smaller communicator would wait for ranks outside it."""
    return list(range(world.Get_size(), 0, -1))


def _fewer(sent: tuple[float, ...], want: tuple[float, ...]) -> str:
    """GLOBAL_COMM if any count of `sent` is below its `want`, else ''."""
    return GLOBAL_COMM if any(s < w for s, w in zip(sent, want)) else ""


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
            + _fewer((forward, backward), want_bytes)
        )
    return None


def check_conjugates(copy: type[torch.autograd.Function], reduce: type[torch.autograd.Function]) -> None:
    """copy, reduce: autograd Functions like ddlab.tensor_parallel.Copy (f) and Reduce (g), apply(x, comm)."""
    world = MPI.COMM_WORLD
    for fn, name in ((copy, "Copy"), (reduce, "Reduce")):

        def body(sub: MPI.Comm, fn: type[torch.autograd.Function] = fn, name: str = name) -> str | None:
            return _check_conjugate(sub, fn, name)

        each_size(world, body, f"{name} ({getattr(fn, '__name__', fn)}) is wrong", _sizes(world))
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
        if size > 1 and sent == 0:
            return "sent nothing, but the ranks must combine their maxima and sums." + GLOBAL_COMM
        return None

    each_size(world, body, "vocab_parallel_cross_entropy is wrong", _sizes(world))
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
                + _fewer((forward, backward), (one, one))
            )
        return None

    each_size(world, body, "the column- and row-parallel layers are wrong", _sizes(world))
    passed(
        world,
        "column_parallel_linear and row_parallel_linear: the split MLP equals one process's, one "
        "allreduce forward and one backward",
    )


#: The attention and block checks' sizes: 4 heads (split 1..4 ways by block_range), a sequence of 10
#: (3 ranks get 4, 3 and 3 of its rows), dropout on in the block.
HEADS, EMBD, BLOCK_BATCH, BLOCK_LENGTH, DROPOUT, SEED = 4, 16, 2, 10, 0.25, 9


def _random_block(dropout: float) -> Block:
    """One process's Block in float64, every weight random (a zero bias would hide a bias added t times)."""
    config = GPTConfig(vocab_size=16, block_size=BLOCK_LENGTH, n_layer=1, n_head=HEADS, n_embd=EMBD, dropout=dropout)
    block = make_gpt(config, seed=0, dtype=torch.float64).blocks[0]
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in block.named_parameters():
            noise = torch.randn(p.shape, dtype=torch.float64, generator=generator)
            p.copy_(1 + noise / 5 if ".ln_" in f".{name}" else noise / 2)
    return cast(Block, block)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    shape = (BLOCK_BATCH, BLOCK_LENGTH, EMBD)
    return torch.randn(shape, dtype=torch.float64, generator=generator), torch.randn(
        shape, dtype=torch.float64, generator=generator
    )


def _first_problem(wants: list[tuple[str, Any, torch.Tensor | None, str]]) -> str | None:
    for label, got, want, hint in wants:
        if want is None:
            continue
        problem = _error(got, want)
        if problem:
            return f"{label} {problem}" + (f": {hint}" if hint else "")
    return None


def _grad(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.grad


def _attention_case(counting: CountingComm, fn: Callable[..., Any]) -> tuple:
    attn = copy.deepcopy(_random_block(0.0).attn)
    x, g = _inputs()
    mine = x.clone().requires_grad_()
    y = fn(mine, attn, counting)
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"the attention must return a tensor, got {type(y).__name__}")
    forward = counting.traffic.bytes_sent
    y.backward(g)
    grads = [_grad(p) for p in (attn.qkv.weight, attn.qkv.bias, attn.proj.weight, attn.proj.bias)]
    return y.detach(), mine.grad, grads, forward, counting.traffic.bytes_sent - forward


def check_parallel_attention(fn: Callable[[torch.Tensor, CausalSelfAttention, Comm], torch.Tensor]) -> None:
    """fn(x, attn, comm) -> the whole output of attn from this rank's heads, as
    ddlab.tensor_parallel.parallel_attention: rank r uses heads block_range(n_head, r, t) only (the other
    rows of attn.qkv and columns of attn.proj get no gradient on it); bytes summed over the ranks: one allreduce
    of the (B, T, n_embd) activations forward, one backward."""
    world = MPI.COMM_WORLD
    one = _random_block(0.0).attn
    x, g = _inputs()
    x.requires_grad_()
    one(x, None, 0).backward(g)

    def body(sub: MPI.Comm) -> str | None:
        size, rank = sub.Get_size(), sub.Get_rank()
        (out, grad_x, grads, forward, backward), _ = run_counted(
            sub, lambda c: _attention_case(c, fn), (), "the parallel attention", timeout=TIMEOUT
        )
        heads = block_range(HEADS, rank, size)
        rows = qkv_rows(EMBD, HEADS, heads)
        d = EMBD // HEADS
        cols = torch.arange(heads.start * d, heads.stop * d)

        def only(grad: torch.Tensor | None, index: torch.Tensor, dim: int) -> torch.Tensor:
            assert grad is not None
            kept = torch.zeros_like(grad)
            kept.index_copy_(dim, index, grad.index_select(dim, index))
            return kept

        by_heads = f"rank {rank} of {size} holds heads {heads.start}..{heads.stop - 1} (block_range): the q, k and v "
        by_heads += "rows of those heads, whole heads of n_embd / n_head features each, and proj's matching columns"
        problem = _first_problem(
            [
                ("the output", out, one(x.detach(), None, 0).detach(), "each head attends with all of its features"),
                ("the input's gradient", grad_x, x.grad, "sum it over the ranks (f) once"),
                ("qkv's weight gradient", grads[0], only(one.qkv.weight.grad, rows, 0), by_heads),
                ("qkv's bias gradient", grads[1], only(one.qkv.bias.grad, rows, 0), by_heads),
                ("proj's weight gradient", grads[2], only(one.proj.weight.grad, cols, 1), by_heads),
                ("proj's bias gradient", grads[3], one.proj.bias.grad, "add the whole bias once, after the sum"),
            ]
        )
        if problem:
            return problem
        totals = sub.allgather((forward, backward))
        sent = (sum(f for f, _ in totals), sum(b for _, b in totals))
        want = 2 * (size - 1) * BLOCK_BATCH * BLOCK_LENGTH * EMBD * 8  # one allreduce, summed over the ranks
        if sent != (want, want):
            return (
                f"the ranks sent {sent[0]:.0f} bytes forward and {sent[1]:.0f} backward in all; expected {want:.0f} "
                f"each: one allreduce of the output forward (after proj) and one of the input's gradient backward "
                f"(before qkv)" + _fewer(sent, (want, want))
            )
        return None

    each_size(world, body, "the attention split by heads is wrong", _sizes(world))
    passed(world, "attention split by heads: output and gradients equal one process's, one allreduce each way")


def _block_parameters(block: Block | BlockParts) -> list[tuple[str, torch.Tensor | None]]:
    """The parameters of a Block, or their counterparts in a BlockParts, in one order, named."""
    attn: Any
    mlp: Any
    if isinstance(block, BlockParts):
        attn, mlp, biases = block.split.attn, block.split.mlp, (block.attn_bias, block.mlp_bias)
    else:
        attn, mlp, biases = block.attn, block.mlp, (block.attn.proj.bias, block.mlp.proj.bias)
    return [
        ("ln_1.weight", block.ln_1.weight),
        ("ln_1.bias", block.ln_1.bias),
        ("ln_2.weight", block.ln_2.weight),
        ("ln_2.bias", block.ln_2.bias),
        ("attn_bias", biases[0]),
        ("mlp_bias", biases[1]),
        ("attn.qkv.weight", attn.qkv.weight),
        ("attn.qkv.bias", attn.qkv.bias),
        ("attn.proj.weight", attn.proj.weight),
        ("mlp.fc.weight", mlp.fc.weight),
        ("mlp.fc.bias", mlp.fc.bias),
        ("mlp.proj.weight", mlp.proj.weight),
    ]


#: How many of `_block_parameters` are whole on every rank (the LayerNorms, the row-parallel biases).
REPLICATED = 6


def _block_case(counting: CountingComm, fn: Callable[..., Any], block: Block) -> tuple:
    parts = BlockParts(copy.deepcopy(block), counting)
    x, g = _inputs()
    rows = block_range(BLOCK_LENGTH, counting.Get_rank(), counting.Get_size())
    mine = x[:, rows.start : rows.stop].clone().requires_grad_()
    y = fn(mine, parts, counting, SEED, BLOCK_LENGTH)
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"the block must return a tensor, got {type(y).__name__}")
    forward = counting.traffic.bytes_sent
    y.backward(g[:, rows.start : rows.stop])
    grads = [_grad(p) for _, p in _block_parameters(parts)]
    return y.detach(), mine.grad, grads, forward, counting.traffic.bytes_sent - forward


def check_sequence_parallel_block(fn: Callable[[torch.Tensor, BlockParts, Comm, int, int], torch.Tensor]) -> None:
    """fn(x, parts, comm, seed, length) -> this rank's rows of a Block's output, as
    ddlab.tensor_parallel.sequence_parallel_block (parts a ddlab.tensor_parallel.BlockParts, dropout on).
    Bytes, summed over the ranks: forward two allgathers and two reduce-scatters of the (B, T, n_embd)
    activations; backward the same four halves, and an allreduce of the six whole parameters' gradients."""
    world = MPI.COMM_WORLD
    block = _random_block(DROPOUT)
    x, g = _inputs()
    x.requires_grad_()
    one = block(x, SEED)
    one.backward(g)
    whole_grad = x.grad
    assert whole_grad is not None

    def body(sub: MPI.Comm) -> str | None:
        size, rank = sub.Get_size(), sub.Get_rank()
        (out, grad_x, grads, forward, backward), _ = run_counted(
            sub, lambda c: _block_case(c, fn, block), (), "the sequence-parallel block", timeout=TIMEOUT
        )
        rows = block_range(BLOCK_LENGTH, rank, size)
        heads = block_range(HEADS, rank, size)
        d = EMBD // HEADS
        hidden = block_range(4 * EMBD, rank, size)
        index = {
            "attn.qkv": (qkv_rows(EMBD, HEADS, heads), 0),
            "attn.proj": (torch.arange(heads.start * d, heads.stop * d), 1),
            "mlp.fc": (torch.arange(hidden.start, hidden.stop), 0),
            "mlp.proj": (torch.arange(hidden.start, hidden.stop), 1),
        }
        seq = slice(rows.start, rows.stop)
        wants: list[tuple[str, Any, torch.Tensor | None, str]] = [
            ("the output", out, one.detach()[:, seq], "each rank drops with its rows of the whole tensor's mask"),
            ("the input's gradient", grad_x, whole_grad[:, seq], ""),
        ]
        summed = "it saw only this rank's rows of the sequence: sum its gradient over the ranks"
        for i, ((name, p), got) in enumerate(zip(_block_parameters(block), grads)):
            want = _grad(p)
            if want is not None and i >= REPLICATED:
                rows_of, dim = index[name.rsplit(".", 1)[0]]
                want = want.index_select(dim, rows_of)
            wants.append((f"{name}'s gradient", got, want, summed if i < REPLICATED else ""))
        problem = _first_problem(wants)
        if problem:
            return problem
        totals = sub.allgather((forward, backward))
        half = (size - 1) * BLOCK_BATCH * BLOCK_LENGTH * EMBD * 8  # one allgather or reduce-scatter, all ranks
        params = sum(p.numel() for _, p in _block_parameters(block)[:REPLICATED] if p is not None)
        want_sent = (4 * half, 4 * half + 2 * (size - 1) * params * 8)
        sent = (sum(f for f, _ in totals), sum(b for _, b in totals))
        if sent != want_sent:
            return (
                f"the ranks sent {sent[0]:.0f} bytes forward and {sent[1]:.0f} backward in all; expected "
                f"{want_sent[0]:.0f} (two allgathers and two reduce-scatters of the (B, T, n_embd) activations: "
                f"{half:.0f} bytes each) and {want_sent[1]:.0f} (the same four halves, and one allreduce of the "
                f"{params} values of the whole parameters' gradients); an allreduce in place of a reduce-scatter "
                f"sends twice the bytes" + _fewer(sent, want_sent)
            )
        return None

    each_size(world, body, "the sequence-parallel block is wrong", _sizes(world))
    passed(
        world,
        "sequence-parallel block: output and every gradient equal one process's, dropout on; two allgathers "
        "and two reduce-scatters each way, the whole parameters' gradients summed",
    )
