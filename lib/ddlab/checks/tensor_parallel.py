"""Checks for lab 14: the conjugate pair, the column- and row-parallel layers, the module surgery
(`parallelize`), the vocabulary-parallel loss, the sequence-parallel block.

Each check runs the student's code on the first P ranks for P = 1 .. world size through
a counting communicator (no MPI collective allowed: the lab's `ddlab.tensor_parallel.allreduce`
and `allgather` are the ring's point-to-point halves, so every byte is counted) and
compares with one process: outputs, the input's gradient, the weights' gradients (from random
output gradients, never a plain sum), and the bytes sent forward and backward. Each runs in float64
(within 1e-10) and in float32 (within 1e-5 of the largest value), the dtypes the lab trains and times
in, and the sequence-parallel block in float16 too (within 5%), the dtype the lab measures its memory in:
an answer that makes a buffer or a result in a fixed dtype fails one of them.
The world's size runs first: an answer on the notebook's global communicator completes there and
fails with a message naming it, where a smaller communicator would wait forever.

Under the grader's seed (ddlab.checks._draw) each check draws its ranks (any of the world's, in any order), its
sizes and its seeds within what the lab states (each check's "The grader's draw" line), names the drawn case and
the seed in every failure, and the seed in its pass line; without one it runs the notebook's cases.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

import torch
import torch.nn.functional as F
from mpi4py import MPI

from ..models.gpt import Block, GPTConfig, make_gpt
from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from ..runtime.counting import CountingComm
from ..runtime.memory import Ledger
from ..tensor_parallel.block import BlockParts, qkv_rows
from ._core import each_size, passed, run_counted
from ._draw import Draw, grading_draw, named

#: How far from one process's values (computed in float64, then cast) an answer may be, times the largest of them
#: (at least 1), by dtype.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-2}
#: The dtypes every check runs an answer in: the lab trains in float64 and times its steps in float32. The
#: sequence-parallel block runs in float16 too, the dtype section 8 measures its activations in.
DTYPES = (torch.float64, torch.float32)
BLOCK_DTYPES = (*DTYPES, torch.float16)
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


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _error(got: Any, want: torch.Tensor) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"is a {type(got).__name__}, not a tensor"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"has shape {tuple(got.shape)} and dtype {got.dtype}, expected {tuple(want.shape)} and {want.dtype}"
    if not want.numel():
        return None
    worst = float((got.detach().double() - want.double()).abs().max())
    limit = TOLERANCE.get(want.dtype, 1e-10) * max(1.0, float(want.abs().max()))
    return None if worst < limit else f"differs from one process's by up to {worst:.3g}"


@dataclass(frozen=True)
class _Tensors:
    """The conjugate check's x: its shape and values (None: the notebook's arange(60) / 7; else a data seed)."""

    shape: tuple[int, ...] = SHAPE
    seed: int | None = None
    draw: Draw | None = None

    def values(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The values in dtype: rank r's x is them (Copy) or r + 1 times them (Reduce)."""
        if self.seed is None:
            return torch.arange(60, dtype=dtype).reshape(SHAPE) / 7
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randn(self.shape, dtype=torch.float64, generator=generator).to(dtype)

    def __str__(self) -> str:
        """'' for the notebook's x; else ', x of shape (...), data seed D (the grader's draw, seed S)'."""
        return "" if self.draw is None else f", x of shape {self.shape}, data seed {self.seed}{named(self.draw)}"


def _drawn_tensors(draw: Draw | None) -> _Tensors:
    """The notebook's x, or a drawn one: 1 to 3 dimensions of 1 to 6 each (x is any float tensor), a data seed."""
    if draw is None:
        return _Tensors()
    shape = tuple(draw.integer(1, 6, "dim", i) for i in range(draw.integer(1, 3, "dims")))
    return _Tensors(shape, draw.data_seed("x"), draw)


def _conjugate_case(
    counting: CountingComm, fn: type[torch.autograd.Function], replicated: bool, dtype: torch.dtype, case: _Tensors
) -> tuple:
    """x through fn forward and backward on this rank; the output, x's gradient, bytes sent each way."""
    rank = counting.Get_rank()
    values = case.values(dtype)
    x = (values if replicated else values * (rank + 1)).clone().requires_grad_()
    y = fn.apply(x, counting)
    forward = counting.traffic.bytes_sent
    y.backward(torch.cos(values) * (rank + 2))
    return y.detach(), x.grad, forward, counting.traffic.bytes_sent - forward


def _first_in_dtypes(
    sub: MPI.Comm, dtypes: tuple[torch.dtype, ...], problem_in: Callable[[torch.dtype], str | None], what: str
) -> str | None:
    """The first dtype's problem, named ("float32 logits: ..."), or None when every dtype passes.

    The ranks of `sub` agree after each dtype: when any rank found a problem, every rank stops there (a rank
    whose own case passed returns None), so none starts the next dtype's collectives alone. An answer that
    goes wrong on some ranks only (one that shifts the targets in place: rank 0's start is 0) fails, never hangs."""
    for dtype in dtypes:
        problem = problem_in(dtype)
        if any(sub.allgather(problem)):
            return (f"{_name(dtype)} {what}: {problem}" if what else problem) if problem else None
    return None


def _check_conjugate(sub: MPI.Comm, fn: type[torch.autograd.Function], name: str, case: _Tensors) -> str | None:
    return _first_in_dtypes(sub, DTYPES, lambda dtype: _conjugate_problem(sub, fn, name, dtype, case), "")


def _conjugate_problem(
    sub: MPI.Comm, fn: type[torch.autograd.Function], name: str, dtype: torch.dtype, case: _Tensors
) -> str | None:
    size = sub.Get_size()
    copy = name == "Copy"
    where = f"{name} ({_name(dtype)}{case})"
    (y, grad, forward, backward), _ = run_counted(
        sub, lambda c: _conjugate_case(c, fn, copy, dtype, case), (), where, timeout=TIMEOUT
    )
    totals = sub.allgather((forward, backward))  # before any rank returns: every rank takes this collective
    values = case.values()
    ranks = torch.arange(1, size + 1, dtype=torch.float64)
    total_grad = torch.cos(values) * float((ranks + 1).sum())
    rank = sub.Get_rank()
    want_y = values if copy else values * float(ranks.sum())
    want_grad = total_grad if copy else torch.cos(values) * (rank + 2)
    e = torch.tensor([], dtype=dtype).element_size()
    # one allreduce, summed over the ranks (each rank's share depends on how x's values are split)
    allreduce_bytes = 2 * (size - 1) * values.numel() * e
    want_bytes = (0.0, allreduce_bytes) if copy else (allreduce_bytes, 0.0)
    what = (
        "forward must return x's values; backward must return the gradient summed over the ranks"
        if copy
        else "forward must return x summed over the ranks; backward must return the gradient unchanged"
    )
    for label, got, want in (("the output", y, want_y), ("x's gradient", grad, want_grad)):
        problem = _error(got, want.to(dtype))
        if problem:
            return f"{where}: {label} {problem}. {name}'s {what}, in x's dtype."
    sent = (sum(f for f, _ in totals), sum(b for _, b in totals))
    if sent != want_bytes:
        return (
            f"{where} sent {sent[0]:.0f} bytes forward and {sent[1]:.0f} backward, its ranks together; expected "
            f"{want_bytes[0]:.0f} and {want_bytes[1]:.0f} (one allreduce of x's {values.numel()} {_name(dtype)} "
            f"values {'backward' if copy else 'forward'}, by ddlab.tensor_parallel.allreduce, nothing else)"
            + _fewer(sent, want_bytes)
        )
    return None


def check_conjugates(copy: type[torch.autograd.Function], reduce: type[torch.autograd.Function]) -> None:
    """copy, reduce: autograd Functions like ddlab.tensor_parallel.Copy (f) and Reduce (g), apply(x, comm).

    The grader's draw: the ranks (any of the world's, in any order), x's shape (1 to 3 dimensions of 1 to 6: the
    lab allows any float tensor) and its values (a data seed); the dtypes stay float64 and float32, as the lab says."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "conjugates")
    case = _drawn_tensors(draw)
    for fn, name in ((copy, "Copy"), (reduce, "Reduce")):

        def body(sub: MPI.Comm, fn: type[torch.autograd.Function] = fn, name: str = name) -> str | None:
            return _check_conjugate(sub, fn, name, case)

        each_size(world, body, f"{name} ({getattr(fn, '__name__', fn)}) is wrong{case}", _sizes(world), draw=draw)
    passed(
        world,
        "Copy and Reduce: values and gradients equal one process's (float64, float32); one allreduce each, Copy's "
        f"backward, Reduce's forward{named(draw)}",
    )


#: Positions and vocabulary of the cross-entropy check: V/t columns per rank well above the 4 values per
#: position a loss that never gathers the logits may send, so gathering them breaks the byte limit; and
#: logits of a few hundred, so a softmax without the largest logit subtracted overflows (e^710 > float64's max,
#: e^89 > float32's).
N, VOCAB, SCALE = 30, 97, 300.0  # a prime vocabulary: no rank count but 1 divides it, so `start` is not rank x V/t


@dataclass(frozen=True)
class _Vocab:
    """The cross-entropy check's case: N positions, a vocabulary of V, the logits' and targets' seed."""

    n: int = N
    vocab: int = VOCAB
    seed: int = 14
    draw: Draw | None = None

    def logits(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The (N, V) logits in dtype (a few hundred, drawn in float64) and the N targets."""
        generator = torch.Generator().manual_seed(self.seed)
        logits = torch.randn(self.n, self.vocab, dtype=torch.float64, generator=generator) * SCALE
        return logits.to(dtype), torch.randint(0, self.vocab, (self.n,), generator=generator)

    def __str__(self) -> str:
        """'' for the notebook's case; else ', N positions, a vocabulary of V, data seed D (the grader's draw...)'."""
        if self.draw is None:
            return ""
        return f", {self.n} positions, a vocabulary of {self.vocab}, data seed {self.seed}{named(self.draw)}"


#: The vocabularies the grader draws from: primes (no rank count but 1 divides them, as the lab says of its 97),
#: at least 41, so that each of 4 ranks holds 10 columns, well above the 4 values per position it may send.
PRIMES = tuple(v for v in range(41, 200) if all(v % d for d in range(2, 15)))


def _drawn_vocab(draw: Draw | None) -> _Vocab:
    """The notebook's case, or 8 to 40 positions, a drawn prime vocabulary of PRIMES and a data seed."""
    if draw is None:
        return _Vocab()
    return _Vocab(draw.integer(8, 40, "positions"), draw.choose(PRIMES, 1, "vocabulary")[0], draw.data_seed(), draw)


def _cross_entropy_case(counting: CountingComm, fn: Callable[..., Any], dtype: torch.dtype, case: _Vocab) -> tuple:
    logits, targets = case.logits(dtype)
    vocab = block_range(case.vocab, counting.Get_rank(), counting.Get_size())
    mine = logits[:, vocab.start : vocab.stop].clone().requires_grad_()
    given = targets.clone()
    loss = fn(mine, given, counting, vocab.start)
    if not isinstance(loss, torch.Tensor) or loss.shape != ():
        raise TypeError(
            f"the loss must be a 0-dim tensor, got {type(loss).__name__} "
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
        )
    (loss * 3).backward()
    untouched = torch.equal(mine.detach(), logits[:, vocab.start : vocab.stop]) and torch.equal(given, targets)
    return loss.detach(), mine.grad, untouched


def check_vocab_parallel_cross_entropy(fn: Callable[[torch.Tensor, torch.Tensor, Comm, int], torch.Tensor]) -> None:
    """fn(logits (N, V_r), targets (N,), comm, start) -> the mean cross-entropy, as
    ddlab.tensor_parallel.vocab_parallel_cross_entropy; at most 4 (t-1) values per position sent per rank.

    The grader's draw: the ranks (any of the world's, in any order), 8 to 40 positions, a prime vocabulary from 41
    to 199 (the lab's 97 is prime: no rank count but 1 divides it) and the logits' and targets' seed; the logits'
    scale (a few hundred) and the dtypes (float64, float32) stay the lab's."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "vocab_parallel_cross_entropy")
    case = _drawn_vocab(draw)

    def body(sub: MPI.Comm) -> str | None:
        return _first_in_dtypes(sub, DTYPES, lambda dtype: _cross_entropy_problem(sub, fn, dtype, case), "logits")

    each_size(world, body, f"vocab_parallel_cross_entropy is wrong{case}", _sizes(world), draw=draw)
    passed(
        world,
        "vocab_parallel_cross_entropy: loss and gradients equal one process's (float64, float32), logits never "
        f"gathered{named(draw)}",
    )


def _cross_entropy_problem(sub: MPI.Comm, fn: Callable[..., Any], dtype: torch.dtype, case: _Vocab) -> str | None:
    size = sub.Get_size()
    (loss, grad, untouched), traffic = run_counted(
        sub,
        lambda c: _cross_entropy_case(c, fn, dtype, case),
        (),
        f"vocab_parallel_cross_entropy ({_name(dtype)}{case})",
        timeout=TIMEOUT,
    )
    if not untouched:
        return "the logits or targets passed in were changed: leave the inputs as they are (no in-place ops)"
    logits, targets = case.logits(dtype)
    logits = logits.double().requires_grad_()
    want = F.cross_entropy(logits, targets)
    (want * 3).backward()
    assert logits.grad is not None
    vocab = block_range(case.vocab, sub.Get_rank(), size)
    problem = _error(loss, want.detach().to(dtype))
    if problem:
        return f"the loss {problem}: {_loss_hint(loss, dtype, logits.detach(), targets, size, float(want.detach()))}"
    problem = _error(grad, logits.grad[:, vocab.start : vocab.stop].to(dtype))
    if problem:
        return f"the gradient of this rank's logits {problem}: {_grad_hint(grad, dtype, logits.detach(), targets, sub)}"
    limit = 4 * (size - 1) * case.n * torch.tensor([], dtype=dtype).element_size()
    sent = traffic[sub.Get_rank()].bytes_sent
    if sent > limit:
        return (
            f"sent {sent} bytes for {case.n} positions over {size} ranks; a loss that never gathers the logits "
            f"needs at most {limit} (4 (t-1) {_name(dtype)} values per position: the maxima, the sums of "
            f"exponentials, the target's logit), whatever the vocabulary"
        )
    if size > 1 and sent == 0:
        return "sent nothing, but the ranks must combine their maxima and sums." + GLOBAL_COMM
    return None


def _assumed_starts(rank: int, size: int, width: int, vocab: int) -> tuple[int, ...]:
    """Where an answer may take rank `rank` of `size`, holding `width` columns of a `vocab` wide vocabulary, to
    start instead of `start` (block_range's start, which the prime vocabulary makes differ on some rank): rank x its
    own width, rank x V // t, rank x ceil(V / t), or 0 (`start` ignored)."""
    return (rank * width, rank * (vocab // size), rank * -(-vocab // size), 0)


def _misplaced_target_losses(logits: torch.Tensor, targets: torch.Tensor, size: int) -> list[float]:
    """The mean losses of answers right in everything but where each rank looks for the target's logit: from a
    first column of `_assumed_starts` instead of `start` (a target that no rank thinks it holds adds nothing to the
    picked logits, one that two ranks think they hold adds twice). Computed from the whole logits, in float64."""
    whole = logits.double()
    n, vocab_size = whole.shape
    largest = whole.max(dim=1).values
    sums = torch.logsumexp(whole - largest.unsqueeze(1), dim=1)
    losses = []
    for which in range(len(_assumed_starts(0, size, 1, vocab_size))):
        picked = torch.zeros(n, dtype=torch.float64)
        for rank in range(size):
            vocab = block_range(vocab_size, rank, size)
            assumed = _assumed_starts(rank, size, len(vocab), vocab_size)[which]
            held = (targets >= assumed) & (targets < assumed + len(vocab))
            columns = vocab.start + (targets - assumed).clamp(0, len(vocab) - 1)
            taken = whole.gather(1, columns.unsqueeze(1)).squeeze(1) - largest
            picked += torch.where(held, taken, torch.zeros_like(taken))
        losses.append(float((sums - picked).mean()))
    return losses


def _loss_hint(
    loss: torch.Tensor, dtype: torch.dtype, logits: torch.Tensor, targets: torch.Tensor, size: int, want: float
) -> str:
    """Why an answer's loss (a 0-dim tensor that differs from one process's `want`, from `dtype` logits) may be
    wrong: another dtype; an overflow when it is not finite; a target's logit looked for from the wrong first column when it equals such a loss; else the
    formula, with what each rank must share."""
    if loss.dtype != dtype:
        return "return the loss in the logits' dtype (make every buffer in it)"
    value = float(loss)
    if value != value or abs(value) == float("inf"):
        return (
            "it is not finite: subtract the largest logit before exp (logits here reach ~1000; e^z overflows past "
            "about 710 in float64, 89 in float32)"
        )
    limit = TOLERANCE[dtype] * max(1.0, abs(want))
    if size > 1 and any(abs(value - other) < limit for other in _misplaced_target_losses(logits, targets, size)):
        return (
            "it is the loss of the right maxima and sums with each target's logit looked for in the wrong columns: is "
            f"the target found with `start`, not rank x V/t? This rank's columns are the vocabulary entries start .. "
            f"start + V_r - 1, and block_range's blocks of the {logits.shape[1]} entries here are uneven: rank x V_r is not "
            "every rank's start"
        )
    return (
        "per position the loss is log sum_v e^(z_v - m) - (z_target - m), with m the largest logit of all the ranks "
        "(the same m on every rank, in the sums and in the target's term), the sums of e^(z - m) over every rank's "
        "columns, and z_target from the one rank whose columns start .. start + V_r - 1 hold the target"
    )


def _grad_hint(grad: Any, dtype: torch.dtype, logits: torch.Tensor, targets: torch.Tensor, sub: MPI.Comm) -> str:
    """Why the gradient of this rank's logits (`grad`, from `dtype` logits; the check back-propagated 3 x the loss)
    may differ from one process's: the incoming gradient ignored, the target's -1 put in the wrong column (a first
    column of `_assumed_starts`), or else the formula."""
    rank, size = sub.Get_rank(), sub.Get_size()
    n, vocab_size = logits.shape
    vocab = block_range(vocab_size, rank, size)
    softmax = torch.softmax(logits.double(), dim=1)[:, vocab.start : vocab.stop]

    def near(want: torch.Tensor) -> bool:
        return isinstance(grad, torch.Tensor) and grad.shape == want.shape and _error(grad, want.to(dtype)) is None

    right = softmax.clone()
    held = (targets >= vocab.start) & (targets < vocab.stop)
    right[held.nonzero().squeeze(1), targets[held] - vocab.start] -= 1
    if near(right / n):
        return "it is the gradient of the loss alone: the check back-propagates 3 x the loss: multiply by the incoming gradient"
    for assumed in _assumed_starts(rank, size, len(vocab), vocab_size):
        misplaced = softmax.clone()
        held = (targets >= assumed) & (targets < assumed + len(vocab))
        misplaced[held.nonzero().squeeze(1), targets[held] - assumed] -= 1
        if assumed != vocab.start and near(3 * misplaced / n):
            return (
                "its -1 at the target is in the wrong column: is the target found with `start`, not rank x V/t? This "
                "rank's columns are the vocabulary entries start .. start + V_r - 1"
            )
    return (
        "for this rank's columns v it is G/N (softmax(z)_v - [v = target]), G the gradient arriving at the loss (the "
        "check back-propagates 3 x the loss), the softmax over all the ranks' columns, the -1 only on the rank that "
        "holds the target, in column target - start"
    )


#: The MLP of the linear-layer check: (batch, sequence, width) in, `HIDDEN` features split over the ranks.
BATCH, LENGTH, WIDTH, HIDDEN = 2, 5, 6, 12


@dataclass(frozen=True)
class _Mlp:
    """The linear-layer check's case: the MLP's sizes, its weights' and data's seed, how the features are dealt
    (None: interleaved, rank r of t holds r, r + t, ...; else the seed of a shuffle dealt out the same way)."""

    batch: int = BATCH
    length: int = LENGTH
    width: int = WIDTH
    hidden: int = HIDDEN
    seed: int = 2
    shuffle: int | None = None
    draw: Draw | None = None

    def features(self, rank: int, size: int) -> torch.Tensor:
        """The index tensor of the hidden features rank `rank` of `size` holds."""
        if self.shuffle is None:
            return torch.arange(rank, self.hidden, size)
        order = torch.randperm(self.hidden, generator=torch.Generator().manual_seed(self.shuffle))
        return order[rank::size].sort().values

    def __str__(self) -> str:
        """'' for the notebook's case; else the sizes and seeds, and the draw's seed."""
        if self.draw is None:
            return ""
        return (
            f", x of shape ({self.batch}, {self.length}, {self.width}), {self.hidden} hidden features dealt by a "
            f"shuffle of seed {self.shuffle}, weights and data of seed {self.seed}{named(self.draw)}"
        )


def _drawn_mlp(draw: Draw | None, size: int) -> _Mlp:
    """The notebook's MLP, or drawn sizes (batch 1-3, sequence 1-6, width 2-8, 1 to 4 hidden features per rank of
    the world's `size`), seeds, and the features dealt from a drawn shuffle (`features` is any index tensor)."""
    if draw is None:
        return _Mlp()
    return _Mlp(
        draw.integer(1, 3, "batch"),
        draw.integer(1, 6, "length"),
        draw.integer(2, 8, "width"),
        draw.integer(size, 4 * size, "hidden"),
        draw.data_seed("weights"),
        draw.data_seed("features"),
        draw,
    )


def _mlp_case(
    counting: CountingComm,
    column: Callable[..., Any],
    row: Callable[..., Any],
    first: torch.nn.Linear,
    second: torch.nn.Linear,
    x: torch.Tensor,
    g: torch.Tensor,
    case: _Mlp,
) -> tuple:
    features = case.features(counting.Get_rank(), counting.Get_size())
    layers = column(copy.deepcopy(first), features, counting), row(copy.deepcopy(second), features, counting)
    held = sum(p.numel() for layer in layers for p in layer.parameters())
    mine = x.detach().clone().requires_grad_()
    y = layers[1](F.gelu(layers[0](mine)))
    forward = counting.traffic.bytes_sent
    y.backward(g)
    kept = [getattr(layer, name, None) for layer in layers for name in ("weight", "bias")]
    grads = [p.grad if isinstance(p, torch.nn.Parameter) else None for p in kept]
    values = [p.detach() if isinstance(p, torch.Tensor) else p for p in kept]
    return y.detach(), mine.grad, values, grads, held, forward, counting.traffic.bytes_sent - forward


def check_parallel_linear(column: Callable[..., Any], row: Callable[..., Any]) -> None:
    """column(linear, features, comm), row(linear, features, comm): modules as ddlab.tensor_parallel's
    ColumnParallelLinear and RowParallelLinear, built from a whole nn.Linear; `features` an index tensor of
    this rank's output features (column) or input features (row). Each keeps `weight` and `bias` as
    parameters holding its shard only (column: those rows and bias entries; row: those columns and the
    whole bias) and nothing else; checked as the two layers of an MLP (column, GELU, row) with interleaved
    features, a backward from random output gradients, and the bytes sent.

    The grader's draw: the ranks (any of the world's, in any order), the MLP's sizes (batch 1-3, sequence 1-6,
    width 2-8, 1 to 4 hidden features per rank), its weights and data (a seed), and which features each rank
    holds (a drawn shuffle dealt out: `features` is any index tensor); the dtypes stay float64 and float32."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "parallel_linear")
    case = _drawn_mlp(draw, world.Get_size())
    generator = torch.Generator().manual_seed(case.seed)
    first = torch.nn.Linear(case.width, case.hidden).double()
    second = torch.nn.Linear(case.hidden, case.width).double()
    with torch.no_grad():
        for p in (*first.parameters(), *second.parameters()):
            p.copy_(torch.randn(p.shape, dtype=torch.float64, generator=generator))
    shape = (case.batch, case.length, case.width)
    x = torch.randn(shape, dtype=torch.float64, generator=generator, requires_grad=True)
    g = torch.randn(shape, dtype=torch.float64, generator=generator)
    y = second(F.gelu(first(x)))
    y.backward(g)

    def body(sub: MPI.Comm) -> str | None:
        return _first_in_dtypes(sub, DTYPES, lambda dtype: in_dtype(sub, dtype), "layers and input")

    def in_dtype(sub: MPI.Comm, dtype: torch.dtype) -> str | None:
        size = sub.Get_size()
        layers = copy.deepcopy(first).to(dtype), copy.deepcopy(second).to(dtype)
        (out, grad_x, values, grads, held, forward, backward), _ = run_counted(
            sub,
            lambda c: _mlp_case(c, column, row, *layers, x.detach().to(dtype), g.to(dtype), case),
            (),
            f"the parallel MLP ({_name(dtype)}{case})",
            timeout=TIMEOUT,
        )
        totals = sub.allgather((forward, backward))  # before any rank returns: every rank takes this collective
        cut = case.features(sub.Get_rank(), size)
        assert first.weight.grad is not None and first.bias.grad is not None
        assert second.weight.grad is not None and second.bias.grad is not None
        where = f"features {cut.tolist()}: "
        shards = [
            ("column's weight", values[0], first.weight.detach()[cut], where + "the rows of those output features"),
            ("column's bias", values[1], first.bias.detach()[cut], where + "the bias entries of those features"),
            ("row's weight", values[2], second.weight.detach()[:, cut], where + "the columns of those input features"),
            ("row's bias", values[3], second.bias.detach(), "the whole bias, the same on every rank"),
        ]
        problem = _first_problem(shards, dtype)
        if problem:
            return problem + " (keep them as self.weight and self.bias, nn.Parameters)"
        want_held = len(cut) * (2 * case.width + 1) + case.width
        if held != want_held:
            return (
                f"the two layers hold {held} parameter values on this rank; their shards are {want_held}: keep "
                "only this rank's shard (not the whole nn.Linear, nor a copy of its weight)"
            )
        wants = [
            ("the output (row's)", out, y.detach(), "row must sum the ranks' parts and then add the bias, once"),
            ("the input's gradient", grad_x, x.grad, "column's backward must sum the input's gradient over ranks"),
            ("column's weight gradient", grads[0], first.weight.grad[cut], ""),
            ("column's bias gradient", grads[1], first.bias.grad[cut], ""),
            ("row's weight gradient", grads[2], second.weight.grad[:, cut], ""),
            ("row's bias gradient", grads[3], second.bias.grad, ""),
        ]
        problem = _first_problem(wants, dtype)
        if problem:
            return problem
        # one allreduce of n values, summed over the ranks (each rank's share depends on how the n are split)
        one = 2 * (size - 1) * case.batch * case.length * case.width * torch.tensor([], dtype=dtype).element_size()
        sent = (sum(f for f, _ in totals), sum(b for _, b in totals))
        if sent != (one, one):
            return (
                f"the ranks sent {sent[0]:.0f} bytes forward and {sent[1]:.0f} backward in all; expected {one:.0f} "
                f"each: one allreduce of the output forward (in row) and one of the input's gradient backward (in "
                "column)" + _fewer(sent, (one, one))
            )
        return None

    each_size(world, body, f"the column- and row-parallel layers are wrong{case}", _sizes(world), draw=draw)
    passed(
        world,
        "column- and row-parallel layers: each keeps only its shard, the split MLP equals one process's (float64, "
        f"float32), one allreduce forward and one backward{named(draw)}",
    )


#: The attention and block checks' sizes: 4 heads (split 1..4 ways by block_range), a sequence of 10
#: (3 ranks get 4, 3 and 3 of its rows), dropout on in the block.
HEADS, EMBD, BLOCK_BATCH, BLOCK_LENGTH, DROPOUT, SEED = 4, 16, 2, 10, 0.25, 9


@dataclass(frozen=True)
class _BlockCase:
    """The block checks' case: the Block's heads and width, the input's batch and sequence, the seeds of the
    weights, of the input and its gradient, and of the dropout masks (the `seed` the block is called with)."""

    heads: int = HEADS
    embd: int = EMBD
    batch: int = BLOCK_BATCH
    length: int = BLOCK_LENGTH
    weights: int = 5
    inputs: int = 3
    seed: int = SEED
    draw: Draw | None = None

    def __str__(self) -> str:
        """'' for the notebook's block; else its sizes and seeds, and the draw's seed."""
        if self.draw is None:
            return ""
        return (
            f", a block of {self.heads} heads and n_embd {self.embd}, x of shape ({self.batch}, {self.length}, "
            f"{self.embd}), weights seed {self.weights}, data seed {self.inputs}, dropout seed {self.seed}"
            f"{named(self.draw)}"
        )


def _drawn_block(draw: Draw | None, size: int) -> _BlockCase:
    """The notebook's block, or a drawn one: `size` (the world's) to 6 heads of 2 to 4 features each, a batch of
    1 to 3, a sequence of `size` to 12 (so every rank holds heads and rows), the weights', data's and dropout's seeds."""
    if draw is None:
        return _BlockCase()
    heads = draw.integer(size, max(size, 6), "heads")
    return _BlockCase(
        heads,
        heads * draw.integer(2, 4, "head width"),
        draw.integer(1, 3, "batch"),
        draw.integer(size, max(size, 12), "length"),
        draw.data_seed("weights"),
        draw.data_seed("inputs"),
        draw.integer(0, 10**6, "dropout seed"),
        draw,
    )


def _random_block(dropout: float, case: _BlockCase) -> Block:
    """One process's Block in float64, every weight random (a zero bias would hide a bias added t times)."""
    config = GPTConfig(
        vocab_size=16, block_size=case.length, n_layer=1, n_head=case.heads, n_embd=case.embd, dropout=dropout
    )
    block = make_gpt(config, seed=0, dtype=torch.float64).blocks[0]
    generator = torch.Generator().manual_seed(case.weights)
    with torch.no_grad():
        for name, p in block.named_parameters():
            noise = torch.randn(p.shape, dtype=torch.float64, generator=generator)
            p.copy_(1 + noise / 5 if ".ln_" in f".{name}" else noise / 2)
    return cast(Block, block)


def _inputs(case: _BlockCase) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(case.inputs)
    shape = (case.batch, case.length, case.embd)
    return torch.randn(shape, dtype=torch.float64, generator=generator), torch.randn(
        shape, dtype=torch.float64, generator=generator
    )


def _first_problem(
    wants: Sequence[tuple[str, Any, torch.Tensor | None, str]], dtype: torch.dtype = torch.float64
) -> str | None:
    """The first of `wants` (label, got, one process's value in float64 or None, hint) that differs from its value
    cast to dtype, said with its hint."""
    for label, got, want, hint in wants:
        if want is None:
            continue
        problem = _error(got, want.to(dtype))
        if problem:
            return f"{label} {problem}" + (f": {hint}" if hint else "")
    return None


def _grad(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.grad


#: Exercise 14.3's plan, and plans it must refuse with a ValueError (with what is wrong with each).
PLAN = {"attn.qkv": "column", "attn.proj": "row", "mlp.fc": "column", "mlp.proj": "row"}
#: Plans that split one sub-layer and leave the other whole (tried in float64): an answer that splits all four
#: layers whatever the plan, or tells a whole attention its heads, fails them.
PARTIAL_PLANS = (
    ({"attn.qkv": "column", "attn.proj": "row"}, "the attention alone split, the MLP whole"),
    ({"mlp.fc": "column", "mlp.proj": "row"}, "the MLP alone split, the attention whole"),
)
BAD_PLANS = (
    ({"attn.qkv": "column"}, "attention's first layer alone"),
    ({"mlp.fc": "column"}, "the MLP's first layer alone"),
    (
        {"attn.qkv": "row", "attn.proj": "column", "mlp.fc": "column", "mlp.proj": "row"},
        "attention the wrong way round",
    ),
    ({"attn.qkv": "column", "attn.proj": "row", "mlp.fc": "row", "mlp.proj": "column"}, "the MLP the wrong way round"),
    ({**PLAN, "mlp.gate": "column"}, "a layer the block lacks"),
)


def _attributes(module: torch.nn.Module) -> dict[str, Any]:
    """A module's own plain attributes (such as attention's `heads`), not its parameters, buffers or children."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_")}


def _parallelize_case(
    counting: CountingComm,
    fn: Callable[..., Any],
    block: Block,
    plan: dict[str, str],
    refusals: bool,
    case: _BlockCase,
) -> tuple:
    """block in the case's dtype split by `plan`; refusals: whether to try the bad plans too."""
    given = copy.deepcopy(block)
    split = fn(given, counting, dict(plan))
    if not isinstance(split, torch.nn.Module):
        raise TypeError(f"parallelize must return the new block (a module), got {type(split).__name__}")
    untouched = (
        all(type(m) is type(o) for m, o in zip(given.modules(), block.modules()))
        and all(_attributes(m) == _attributes(o) for m, o in zip(given.modules(), block.modules()))
        and all(torch.equal(p, q) for p, q in zip(given.parameters(), block.parameters()))
    )
    held = sum(p.numel() for p in split.parameters())
    x, g = (t.to(block.ln_1.weight.dtype) for t in _inputs(case))
    mine = x.clone().requires_grad_()
    try:
        y = split(mine, case.seed)
    except Exception as err:  # the answer's block failed: say with which plan, and what attn.heads says
        raise RuntimeError(
            f"the split block's forward failed with the plan {plan} ({type(err).__name__}: {err}): "
            + _heads_advice(split, block, plan, counting.Get_size())
        ) from None
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"the split block must return a tensor, got {type(y).__name__}")
    forward = counting.traffic.bytes_sent
    y.backward(g)
    grads = [
        _grad(split.get_submodule(name.rpartition(".")[0]).get_parameter(name.rpartition(".")[2]))
        for name in _SPLIT_NAMES
    ]
    refused = []
    for plan, why in BAD_PLANS if refusals else ():
        try:
            fn(copy.deepcopy(block), counting, dict(plan))
        except ValueError:
            continue
        except Exception as err:  # noqa: BLE001 (any other error is the student's, and reported)
            refused.append((plan, why, f"raised {type(err).__name__}: {err}"))
            continue
        refused.append((plan, why, "returned a block"))
    return y.detach(), mine.grad, grads, held, untouched, refused, forward, counting.traffic.bytes_sent - forward


def _heads_advice(split: torch.nn.Module, block: Block, plan: dict[str, str], size: int) -> str:
    """What to do about a split block whose forward failed, from its attention's `heads` against the whole block's:
    left naming all heads though attn.qkv is split, set though the attention stays whole, or else the general rule."""
    heads = getattr(getattr(split, "attn", None), "heads", None)
    every = block.attn.heads
    if "attn.qkv" in plan and size > 1 and heads == every:
        return (
            f"the attention was split but attn.heads still names all {len(every)} heads: set it to "
            "head_range(n_head, comm), this rank's heads, when attn.qkv is split"
        )
    if "attn.qkv" not in plan and heads != every:
        return (
            f"the attention stays whole here but attn.heads was set to {heads}: set attn.heads only when the "
            "attention is split (attn.qkv in the plan), and replace only the layers the plan names"
        )
    return (
        "replace only the layers the plan names, and set attn.heads to head_range(n_head, comm) exactly when "
        "attn.qkv is split"
    )


#: The parameters of a Block, by name, in the order `_parallelize_case` returns their gradients.
_SPLIT_NAMES = (
    "ln_1.weight",
    "ln_1.bias",
    "ln_2.weight",
    "ln_2.bias",
    "attn.qkv.weight",
    "attn.qkv.bias",
    "attn.proj.weight",
    "attn.proj.bias",
    "mlp.fc.weight",
    "mlp.fc.bias",
    "mlp.proj.weight",
    "mlp.proj.bias",
)


def _shard_index(
    name: str, rank: int, size: int, plan: dict[str, str], case: _BlockCase
) -> tuple[torch.Tensor, int] | None:
    """(index, dim) of this rank's shard of a Block's parameter `name` under `plan`, or None if it stays whole."""
    if name.rpartition(".")[0] not in plan:
        return None
    heads = block_range(case.heads, rank, size)
    d = case.embd // case.heads
    hidden = block_range(4 * case.embd, rank, size)
    index = {
        "attn.qkv.weight": (qkv_rows(case.embd, case.heads, heads), 0),
        "attn.qkv.bias": (qkv_rows(case.embd, case.heads, heads), 0),
        "attn.proj.weight": (torch.arange(heads.start * d, heads.stop * d), 1),
        "mlp.fc.weight": (torch.arange(hidden.start, hidden.stop), 0),
        "mlp.fc.bias": (torch.arange(hidden.start, hidden.stop), 0),
        "mlp.proj.weight": (torch.arange(hidden.start, hidden.stop), 1),
    }
    return index.get(name)


def check_parallelize(fn: Callable[[Block, Comm, dict[str, str]], torch.nn.Module]) -> None:
    """fn(block, comm, plan) -> a new block, as ddlab.tensor_parallel.parallelize: the layers the plan names
    replaced by ones holding this rank's shard (attention by heads block_range(n_head, r, t), the MLP by
    hidden features block_range(4 n_embd, r, t)), the block passed in left as it was, every parameter value
    held a shard's or a LayerNorm's or a row layer's whole bias; output and gradients equal one process's
    with dropout on; one allreduce per split sub-layer each way; run with Megatron's plan, and in float64 with
    plans that split only the attention or only the MLP (the other stays whole, its attention without heads);
    a plan naming an unknown layer, a pair split the wrong way round, or one layer of a pair alone raises
    ValueError.

    The grader's draw: the ranks (any of the world's, in any order), the block (the world's size to 6 heads of 2 to
    4 features), the input's batch (1 to 3) and sequence (the world's size to 12), the seeds of the weights, the
    input and the dropout; the plans and the dtypes stay the lab's."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "parallelize")
    case = _drawn_block(draw, world.Get_size())
    block = _random_block(DROPOUT, case)
    x, g = _inputs(case)
    x.requires_grad_()
    one = copy.deepcopy(block)
    want_y = one(x, case.seed)
    want_y.backward(g)

    def body(sub: MPI.Comm) -> str | None:
        return _first_in_dtypes(sub, DTYPES, lambda dtype: in_dtype(sub, dtype), "block and input")

    def in_dtype(sub: MPI.Comm, dtype: torch.dtype) -> str | None:
        plans = [(PLAN, "")] + [(plan, f"with the plan {plan} ({why})") for plan, why in PARTIAL_PLANS]
        for plan, label in plans if dtype == DTYPES[0] else plans[:1]:
            problem = in_plan(sub, dtype, plan)
            if any(sub.allgather(problem)):  # every rank stops at the same plan
                return f"{label}: {problem}" if label and problem else problem
        return None

    def in_plan(sub: MPI.Comm, dtype: torch.dtype, plan: dict[str, str]) -> str | None:
        size, rank = sub.Get_size(), sub.Get_rank()
        given = copy.deepcopy(block).to(dtype)
        (out, grad_x, grads, held, untouched, refused, forward, backward), _ = run_counted(
            sub,
            lambda c: _parallelize_case(c, fn, given, plan, dtype == DTYPES[0] and plan is PLAN, case),
            (),
            f"parallelize ({_name(dtype)}{case})",
            timeout=TIMEOUT,
        )
        totals = sub.allgather((forward, backward))  # before any rank returns: every rank takes this collective
        if not untouched:
            return (
                "the block passed in was changed (its layers, parameters or attributes such as attn.heads): "
                "work on a copy (copy.deepcopy) and change only the copy"
            )
        if refused:
            plan, why, what = refused[0]
            return (
                f"the plan {plan} ({why}) should raise ValueError: each sub-layer splits as a pair, its first "
                f"layer 'column' and its second 'row', and names only the block's layers; it {what}"
            )
        heads = block_range(case.heads, rank, size)
        by_heads = f"rank {rank} of {size} holds heads {heads.start}..{heads.stop - 1} (block_range) and hidden "
        by_heads += "features block_range(4 n_embd, rank, t): those rows of qkv (of q, k and v) and fc, those columns "
        by_heads += "of the projections"
        output_hint = "each rank's heads drop with their part of the whole mask"
        if "attn.qkv" not in plan:
            output_hint = "the attention stays whole here: split only the layers the plan names, and leave attn.heads"
        elif "mlp.fc" not in plan:
            output_hint = "the MLP stays whole here: split only the layers the plan names"
        wants: list[tuple[str, Any, torch.Tensor | None, str]] = [
            ("the output", out, want_y.detach(), output_hint),
            ("the input's gradient", grad_x, x.grad, ""),
        ]
        whole = 0
        for name, got in zip(_SPLIT_NAMES, grads):
            want = one.get_parameter(name).grad
            shard = _shard_index(name, rank, size, plan, case)
            if shard is not None and want is not None:
                want = want.index_select(shard[1], shard[0])
            whole += 0 if want is None else want.numel()
            whole_here = name.rpartition(".")[0] in PLAN and not shard
            hint = by_heads if shard else "the plan leaves this layer whole: split only the layers it names"
            wants.append((f"{name}'s gradient", got, want, hint if shard or whole_here else ""))
        problem = _first_problem(wants, dtype)
        if problem:
            return problem
        if held != whole:
            return (
                f"the new block holds {held} parameter values on this rank; its shards and whole LayerNorms and "
                f"biases are {whole}: keep only the shards (not the whole layers)"
            )
        sent = (sum(f for f, _ in totals), sum(b for _, b in totals))
        e = torch.tensor([], dtype=dtype).element_size()
        pairs = sum(first in plan for first in ("attn.qkv", "mlp.fc"))
        want_sent = (
            pairs * 2 * (size - 1) * case.batch * case.length * case.embd * e
        )  # an allreduce per pair, all ranks
        if sent != (want_sent, want_sent):
            return (
                f"the ranks sent {sent[0]:.0f} bytes forward and {sent[1]:.0f} backward in all; expected "
                f"{want_sent:.0f} each: one allreduce after each split sub-layer forward, one before its "
                f"backward, and none for a sub-layer the plan leaves whole" + _fewer(sent, (want_sent, want_sent))
            )
        return None

    each_size(world, body, f"parallelize does not make a tensor-parallel block{case}", _sizes(world), draw=draw)
    passed(
        world,
        "parallelize: every rank keeps its shards only; the split block equals one process's (dropout on; float64, "
        f"float32), one allreduce per sub-layer each way; bad plans refused{named(draw)}",
    )


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


def _block_case(counting: CountingComm, fn: Callable[..., Any], block: Block, case: _BlockCase) -> tuple:
    """block in the case's dtype."""
    parts = BlockParts(copy.deepcopy(block), counting)
    x, g = (t.to(block.ln_1.weight.dtype) for t in _inputs(case))
    rows = block_range(case.length, counting.Get_rank(), counting.Get_size())
    mine = x[:, rows.start : rows.stop].clone().requires_grad_()
    ledger = Ledger()
    ledger.ignore(parts)
    with ledger.activations():
        y = fn(mine, parts, counting, case.seed, case.length)
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"the block must return a tensor, got {type(y).__name__}")
    kept = ledger.used["activations"]
    forward = counting.traffic.bytes_sent
    y.backward(g[:, rows.start : rows.stop])
    grads = [_grad(p) for _, p in _block_parameters(parts)]
    return y.detach(), mine.grad, grads, kept, forward, counting.traffic.bytes_sent - forward


#: How far over Korthikanti et al.'s count a sequence-parallel block may keep (besides the LayerNorms' statistics
#: and weights, allowed for apart).
MEMORY_SLACK = 1.02


def _korthikanti_bytes(rows: int, heads: int, hidden: int, case: _BlockCase, e: int = 8) -> int:
    """Korthikanti et al.'s sbh(34/t + 5as/(ht)) term by term (section 4.2.2) for this rank's share of the check's
    block: `rows` of the sequence, `heads` heads, `hidden` MLP features; e-byte values, 1-byte masks."""
    b, s, h, d = case.batch, case.length, case.embd, case.embd // case.heads
    per_row = h * (2 * e + 2 * e + 2)  # the LayerNorms' and the column layers' inputs, two residual masks
    return b * (rows * per_row + s * heads * d * 4 * e + s * hidden * 2 * e + s * s * heads * (2 * e + 1))


def check_sequence_parallel_block(fn: Callable[[torch.Tensor, BlockParts, Comm, int, int], torch.Tensor]) -> None:
    """fn(x, parts, comm, seed, length) -> this rank's rows of a Block's output, as
    ddlab.tensor_parallel.sequence_parallel_block (parts a ddlab.tensor_parallel.BlockParts, dropout on).
    Bytes, summed over the ranks: forward two allgathers and two reduce-scatters of the (B, T, n_embd)
    activations; backward the same four halves, the column layers' inputs allgathered again, and the six whole
    parameters' gradients summed by allreduce (one per parameter, as MyCopy does, or one of them all: the same
    bytes). What autograd keeps (the lab's Ledger) at most 2% over
    Korthikanti et al.'s count for this rank's share (rows, heads, hidden features), plus the LayerNorms' weights
    and biases (a copy of them, saved by F.layer_norm, when MyCopy returns one) and their per-row statistics.

    The grader's draw: the ranks (any of the world's, in any order), the block (the world's size to 6 heads of 2 to
    4 features), the input's batch (1 to 3) and sequence `length` (the world's size to 12: every rank holds rows),
    the seeds of the weights, the input and the dropout (`seed`); the dtypes stay the lab's three."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "sequence_parallel_block")
    case = _drawn_block(draw, world.Get_size())
    block = _random_block(DROPOUT, case)
    x, g = _inputs(case)
    x.requires_grad_()
    one = block(x, case.seed)
    one.backward(g)
    whole_grad = x.grad
    assert whole_grad is not None

    def body(sub: MPI.Comm) -> str | None:
        return _first_in_dtypes(sub, BLOCK_DTYPES, lambda dtype: in_dtype(sub, dtype), "block and input")

    def in_dtype(sub: MPI.Comm, dtype: torch.dtype) -> str | None:
        size, rank = sub.Get_size(), sub.Get_rank()
        given = copy.deepcopy(block).to(dtype)
        (out, grad_x, grads, kept, forward, backward), _ = run_counted(
            sub,
            lambda c: _block_case(c, fn, given, case),
            (),
            f"the sequence-parallel block ({_name(dtype)}{case})",
            timeout=TIMEOUT,
        )
        totals = sub.allgather((forward, backward))  # before any rank returns: every rank takes this collective
        e = torch.tensor([], dtype=dtype).element_size()
        rows = block_range(case.length, rank, size)
        heads = block_range(case.heads, rank, size)
        d = case.embd // case.heads
        hidden = block_range(4 * case.embd, rank, size)
        index = {
            "attn.qkv": (qkv_rows(case.embd, case.heads, heads), 0),
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
        problem = _first_problem(wants, dtype)
        if problem:
            return problem
        limit = _korthikanti_bytes(len(rows), len(heads), len(hidden), case, e)
        # Korthikanti et al. count activations: F.layer_norm also saves its weight and bias, new storage
        # (counted) when MyCopy returns a copy, as 14.1 allows; the four LayerNorm vectors are not held against it.
        norms = e * sum(p.numel() for p in (block.ln_1.weight, block.ln_1.bias, block.ln_2.weight, block.ln_2.bias))
        # nor the statistics each LayerNorm saves per row (a mean and a reciprocal deviation, at least float32):
        # a few percent of a small block's count (n_embd 8, a sequence of 5), not held against it either.
        norms += 2 * 2 * case.batch * len(rows) * max(e, 4)
        if kept > MEMORY_SLACK * limit + norms:
            return (
                f"the block keeps {kept} bytes for backward on this rank, {kept / limit:.2f} times Korthikanti et "
                f"al.'s count for its share ({limit} bytes: {len(rows)} of the {case.length} rows, {len(heads)} "
                f"heads, {len(hidden)} hidden features); the LayerNorms must run on this rank's rows, before the "
                "allgather, and the column-parallel layers keep only this rank's block of their input (allgather "
                "it again in backward)"
            )
        half = (size - 1) * case.batch * case.length * case.embd * e  # one allgather or reduce-scatter, all ranks
        params = sum(p.numel() for _, p in _block_parameters(block)[:REPLICATED] if p is not None)
        want_sent = (4 * half, 6 * half + 2 * (size - 1) * params * e)
        sent = (sum(f for f, _ in totals), sum(b for _, b in totals))
        if sent != want_sent:
            return (
                f"the ranks sent {sent[0]:.0f} bytes forward and {sent[1]:.0f} backward in all; expected "
                f"{want_sent[0]:.0f} (two allgathers and two reduce-scatters of the (B, T, n_embd) activations: "
                f"{half:.0f} bytes each) and {want_sent[1]:.0f} (the same four halves, the two column layers' "
                f"inputs allgathered again, and the whole parameters' gradients, {params} values, summed by "
                f"allreduce: one per parameter or one of them all); an allreduce in place of a reduce-scatter "
                f"sends twice the bytes" + _fewer(sent, want_sent)
            )
        return None

    each_size(world, body, f"the sequence-parallel block is wrong{case}", _sizes(world), draw=draw)
    passed(
        world,
        "sequence-parallel block: output and every gradient equal one process's, dropout on (float64, float32, "
        "float16); "
        "keeps Korthikanti "
        "et al.'s bytes (its sequence block only); two allgathers and two reduce-scatters each way, the inputs "
        f"regathered in backward, the whole parameters' gradients summed{named(draw)}",
    )
