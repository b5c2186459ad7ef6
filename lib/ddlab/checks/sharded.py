"""Checks of lab 13 (sharded data parallelism): the ring's two halves, and resharding a checkpoint.

- `check_reduce_scatter(fn)`: fn(comm, x, bounds) -> a new array, on rank r the sum over ranks
  of x[bounds[r]:bounds[r+1]]; point-to-point messages only; x left alone; no more bytes
  than the ring's reduce-scatter.
- `check_allgather(fn)`: fn(comm, mine, bounds) -> a new array of bounds[-1] items, rank q's
  `mine` at bounds[q]:bounds[q+1]; point-to-point only; each call a fresh array (the caller
  keeps it: a buffer reused by the next call would change it); no more bytes than the ring's.
- `check_sharded_optimizer(cls)`: cls(params, optimizer_class, comm, **kwargs), ZeRO-1 around any
  torch.optim class: the inner optimizer over this rank's flat shard only, a reduce-scatter of the
  gradients, the inner step, an allgather; equal to one process with SGD-momentum and Adam.
- `check_zero2_hooks(fn)`: fn(unit, comm, keep) makes ZeRO-2's difference: a unit's gradient
  reduce-scattered in its last post-accumulate-grad hook, keep(mean shard) called, the full gradient freed.
- `check_zero3_unit(fn)`: fn(unit, comm) -> shard builds a ZeRO-3 unit: the flat buffer its parameters
  view, this rank's master shard, its storage freed; gather before forward, free after, gather before
  backward, reduce-scatter the mean gradient into shard.grad and free once its gradients are all there;
  in float64 and float32, the freed bytes counted (autograd's saved tensors too).
- `check_reshard(fn)`: fn(shards, numel, size, rank) -> rank's shard of the flat buffer cut
  for `size` ranks, from the shards another rank count wrote (padding is zeros); float64, float32
  and bfloat16 bits, a new array in the shards' dtype on every call, the old shards left alone.

Bounds come as the flat space of lab 13 cuts them (equal shards) and unevenly: a short
last shard, and a rank with an empty one, so an answer that assumes equal shards fails.

Graded (ddlab.checks._draw), each check runs cases drawn within what the lab states instead of the
notebook's: any ranks in any order, shard layouts whose longest shard is not the first, units
without a bias, other model widths, optimizers and hyper-parameters, rank-count chains; each
check's docstring says what it draws.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from ..allreduce import allgather_ring, reduce_scatter_ring
from ..runtime.blocks import block_bounds
from ..runtime.comm import Comm
from ..runtime.counting import Traffic
from ._core import (
    NOTHING_SENT,
    REORDERED,
    array_problem,
    count,
    each_size,
    fail_together,
    passed,
    reordered_hint,
    run_counted,
)
from ._draw import Draw, grading_draw, named
from .errors import CheckFailed

#: Slack over the ring's bytes (the ring is optimal up to message boundaries).
BYTES_SLACK = 1.05


def _cases(size: int, draw: Draw | None = None) -> list[tuple[str, list[int]]]:
    """(description, bounds) for a communicator of `size` ranks.

    The notebook's layouts all put the longest shard first; the grader's draw (any bounds the lab allows:
    shards of any length, the last short, some empty) has shards of up to 12 items: equal ones, a short
    last one, the first one empty, and any lengths with one of them empty."""
    if draw is not None:
        return _drawn_cases(size, draw)
    equal = 3 * size
    uneven = [*block_bounds(3 * size - 2, size - 1), 3 * size - 2] if size > 1 else [0, 5]
    short_last = [min(4 * r, 4 * size - 3) for r in range(size)] + [4 * size - 3]
    empty = [0, *range(1, size), size - 1] if size > 1 else [0, 0]
    return [
        (f"{equal} items in equal shards", [r * 3 for r in range(size + 1)]),
        (f"{short_last[-1]} items, the last shard short", short_last),
        (f"{uneven[-1]} items, the last rank's shard empty", uneven),
        (f"{empty[-1]} items, some shards empty", empty),
    ]


def _drawn_cases(size: int, draw: Draw) -> list[tuple[str, list[int]]]:
    """The grader's four layouts for `size` ranks, each described by its bounds."""
    equal = draw.integer(1, 12, "equal", size)
    longest = draw.integer(2, 12, "short", size)
    short_last = [*([longest] * (size - 1)), draw.integer(1, longest - 1, "last", size)]
    first_empty = [0, *(draw.integer(1, 12, "first empty", size, r) for r in range(1, size))]
    some_empty = [draw.integer(0, 12, "some empty", size, r) for r in range(size)]
    some_empty[draw.integer(0, size - 1, "which empty", size)] = 0
    layouts = [
        ("equal shards", [equal] * size),
        ("the last shard short", short_last),
        ("the first shard empty", first_empty),
        ("shards of any length, one empty", some_empty),
    ]
    cases = []
    for description, lengths in layouts:
        bounds = [0, *np.cumsum(lengths).tolist()]
        cases.append((f"{bounds[-1]} items, {description}, bounds {bounds}", [int(b) for b in bounds]))
    return cases


def rank_hint(sub: MPI.Comm, comm: MPI.Comm, draw: Draw | None) -> str:
    """reordered_hint, or under the grader's draw: the hint on the reordered run only (each_size names the
    drawn ranks of the others). Every rank computes the same answer, without a message."""
    if draw is None:
        return reordered_hint(sub, comm)
    size = comm.Get_size()
    if sub.Get_size() != size or size == 1:
        return ""
    group, whole = sub.Get_group(), comm.Get_group()
    members = MPI.Group.Translate_ranks(group, list(range(size)), whole)
    group.Free()
    whole.Free()
    return f"(this run's ranks are{REORDERED})" if list(members) == [(q - 1) % size for q in range(size)] else ""


def _data_seed(draw: Draw | None, *keys: object) -> tuple[list[int], str]:
    """(keys to seed a case's data with, the words naming them): the notebook's none, or the grader's seed."""
    if draw is None:
        return [], ""
    seed = draw.data_seed(*keys)
    return [seed], f", data seed {seed}{named(draw)}"


def _sent(traffic: list[Traffic]) -> int:
    return sum(t.bytes_sent for t in traffic)


def _bytes_problem(traffic: list[Traffic], reference: list[Traffic]) -> str | None:
    got, ring = _sent(traffic), _sent(reference)
    if ring > 0 and got == 0:
        return NOTHING_SENT
    if got > ring * BYTES_SLACK + 64:
        return (
            f"the ranks sent {got} bytes in all, the ring sends {ring}: each rank should send every chunk but "
            "its own once (pass partial sums on, or send each chunk straight to its owner), not whole buffers"
        )
    return None


def check_reduce_scatter(fn: Callable[[Any, np.ndarray, list[int]], np.ndarray]) -> None:
    """fn(comm, x, bounds) -> new array: the sum over ranks of x[bounds[r]:bounds[r+1]] on rank r.

    The grader's draw: the ranks of each communicator (any of the world's, in any order), four layouts of
    shards of up to 12 items (equal, the last short, the first empty, any lengths with one empty; see
    _cases), and the data; float64 and float32 as the lab states."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "reduce_scatter")

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        hint = rank_hint(sub, comm, draw)
        for index, (description, bounds) in enumerate(_cases(size, draw)):
            for dtype in (np.float64, np.float32):
                seed, seeded = _data_seed(draw, "reduce_scatter", size, index, np.dtype(dtype).name)
                context = f"reduce_scatter ({description}, {np.dtype(dtype).name}{seeded})"
                x = np.random.default_rng([*seed, bounds[-1], rank]).integers(-9, 9, bounds[-1]).astype(dtype)
                before = x.copy()
                got, traffic = run_counted(sub, fn, (x, list(bounds)), context)
                _, reference = run_counted(sub, reduce_scatter_ring, (before.copy(), list(bounds)), "the reference")
                total = np.empty_like(before)
                sub.Allreduce(before, total, op=MPI.SUM)
                problem = array_problem(got, total[bounds[rank] : bounds[rank + 1]], f"rank {rank}'s shard")
                if problem is None and not np.array_equal(x, before):
                    problem = "x was changed: work on copies of its chunks (the caller still needs its gradients)"
                if problem is None and np.shares_memory(got, x):
                    problem = "the result shares memory with x: return a new array"
                found = problem or _bytes_problem(traffic, reference)
                fail_together(sub, found and f"{context}: {found}", "reduce_scatter", hint)
        return None

    each_size(
        comm, body, "reduce_scatter", sizes=[comm.Get_size(), *range(1, comm.Get_size())], reordered=True, draw=draw
    )
    passed(
        comm,
        f"reduce_scatter: each rank gets the sums of its own shard, equal or uneven, in the ring's bytes{named(draw)}",
    )


#: What the trainer hands allgather, case by case: float64 and float32 parameters, and bfloat16 ones
#: as their int16 bits (NumPy has no bfloat16). Four layouts, so each dtype meets an uneven one.
ALLGATHER_DTYPES = (np.float64, np.int16, np.float32, np.int16)


def _allgather_dtypes(size: int, draw: Draw | None) -> tuple[type, ...]:
    """The notebook's dtypes by layout, or the grader's: the three in a drawn order, and a fourth drawn."""
    if draw is None:
        return ALLGATHER_DTYPES
    kinds = (np.float64, np.float32, np.int16)
    order = draw.rng("dtypes", size).permutation(len(kinds))
    return (*(kinds[i] for i in order), *draw.choose(kinds, 1, "fourth dtype", size))


def check_allgather(fn: Callable[[Any, np.ndarray, list[int]], np.ndarray]) -> None:
    """fn(comm, mine, bounds) -> new array of bounds[-1] items, rank q's piece at bounds[q]:bounds[q+1].

    The grader's draw: the ranks of each communicator (any of the world's, in any order), the four layouts
    of check_reduce_scatter's draw, which of the trainer's dtypes meets which layout (float64, float32 and
    bfloat16 bits, each at least once), and the data."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "allgather")

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        hint = rank_hint(sub, comm, draw)
        for index, ((description, bounds), dtype) in enumerate(zip(_cases(size, draw), _allgather_dtypes(size, draw))):
            seed, seeded = _data_seed(draw, "allgather", size, index)
            context = (
                f"allgather ({description}, {np.dtype(dtype).name}{' = bfloat16 bits' if dtype == np.int16 else ''}"
                f"{seeded})"
            )
            results, wants = [], []
            for call in range(2):  # two calls: the first result must survive the second
                generator = np.random.default_rng([*seed, bounds[-1], call])
                full: np.ndarray = (100 * generator.standard_normal(bounds[-1])).astype(dtype)
                mine = full[bounds[rank] : bounds[rank + 1]].copy()
                got, traffic = run_counted(sub, fn, (mine, list(bounds)), context)
                _, reference = run_counted(sub, allgather_ring, (mine.copy(), list(bounds)), "the reference")
                problem = array_problem(got, full, "the gathered buffer")
                if problem is None and np.shares_memory(got, mine):
                    problem = "the result shares memory with `mine`: return a new array"
                found = problem or _bytes_problem(traffic, reference)
                fail_together(sub, found and f"{context}: {found}", "allgather", hint)
                results.append(got)
                wants.append(full)
            found = None
            if np.shares_memory(results[0], results[1]) or not np.array_equal(results[0], wants[0]):
                found = (
                    f"{context}: the second call changed the first call's result: each call must return a "
                    "new array (a buffer reused across calls overwrites the parameters a unit still uses)"
                )
            fail_together(sub, found, "allgather", hint)
        return None

    each_size(comm, body, "allgather", sizes=[comm.Get_size(), *range(1, comm.Get_size())], reordered=True, draw=draw)
    passed(
        comm,
        f"allgather: every rank gets every shard, equal or uneven, in a new array, in the ring's bytes{named(draw)}",
    )


#: Exercise 13.3's inner optimizers: (name, class, keyword arguments).
OPTIMIZERS: list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]] = [
    ("SGD with momentum 0.9", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ("Adam", torch.optim.Adam, {"lr": 0.05, "weight_decay": 1e-3}),
]
OPTIMIZER_STEPS = 3
#: Relative tolerance against one process, per dtype (float64: the course's 1e-10).
OPTIMIZER_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}


@dataclass(frozen=True)
class _OptimizerCase:
    """Exercise 13.3's model and data: Linear(widths[0], widths[1]), tanh, Linear(widths[1], widths[2]);
    `samples` per rank and step; the seeds of the parameters and of the batches (None: the notebook's)."""

    widths: tuple[int, int, int] = (5, 4, 2)
    samples: int = 3
    seed: int | None = None

    def __str__(self) -> str:
        a, b, c = self.widths
        numel = a * b + b + b * c + c
        return f"a {a} -> {b} -> {c} model ({numel} parameters), {count(self.samples, 'sample')} per rank, data seed {self.seed}"


def _drawn_optimizers(draw: Draw) -> list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]]:
    """Two of the element-wise torch.optim classes the lab allows, with drawn hyper-parameters."""
    rng = draw.rng("optimizers")
    momentum = float(rng.choice([0.0, 0.5, 0.9]))
    domain: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
        (
            torch.optim.SGD,
            {
                "lr": round(float(rng.uniform(0.01, 0.2)), 3),
                "momentum": momentum,
                "nesterov": momentum > 0 and bool(rng.integers(2)),
                "weight_decay": float(rng.choice([0.0, 1e-3])),
            },
        ),
        (
            torch.optim.Adam,
            {
                "lr": round(float(rng.uniform(0.005, 0.1)), 3),
                "weight_decay": float(rng.choice([0.0, 1e-3])),
                "amsgrad": bool(rng.integers(2)),
            },
        ),
        (torch.optim.AdamW, {"lr": round(float(rng.uniform(0.005, 0.1)), 3), "weight_decay": 1e-2}),
        (
            torch.optim.RMSprop,
            {"lr": round(float(rng.uniform(0.001, 0.02)), 4), "momentum": float(rng.choice([0.0, 0.9]))},
        ),
        (torch.optim.Adagrad, {"lr": round(float(rng.uniform(0.01, 0.2)), 3)}),
    ]
    return [
        (f"{cls.__name__}({', '.join(f'{k}={v}' for k, v in kwargs.items())})", cls, kwargs)
        for cls, kwargs in draw.choose(domain, 2, "classes")
    ]


def _optimizer_case(size: int, draw: Draw | None) -> _OptimizerCase:
    """The notebook's model and data, or the grader's: widths up to 6, 6 and 3, 1 to 4 samples, a data seed."""
    if draw is None:
        return _OptimizerCase()
    widths = (draw.integer(1, 6, "in", size), draw.integer(1, 6, "hidden", size), draw.integer(1, 3, "out", size))
    return _OptimizerCase(widths, draw.integer(1, 4, "samples", size), draw.data_seed("optimizer", size))


def _optimizer_model(dtype: torch.dtype, case: _OptimizerCase) -> nn.Sequential:
    """a -> b -> c with a tanh (the notebook's 5 -> 4 -> 2: 34 parameters, which 3 and 4 ranks cannot split
    evenly: the shards need padding)."""
    generator = torch.Generator().manual_seed(133 if case.seed is None else case.seed)
    a, b, c = case.widths
    model = nn.Sequential(nn.Linear(a, b), nn.Tanh(), nn.Linear(b, c)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=dtype))
    return model


def _optimizer_batches(size: int, dtype: torch.dtype, case: _OptimizerCase) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch of `case.samples` samples per rank for each step."""
    generator = torch.Generator().manual_seed(size if case.seed is None else case.seed + size)
    n, (a, _, c) = case.samples * size, case.widths
    return [
        (torch.randn(n, a, generator=generator, dtype=dtype), torch.randn(n, c, generator=generator, dtype=dtype))
        for _ in range(OPTIMIZER_STEPS)
    ]


def _optimizer_problem(
    fn: Callable[..., Any],
    sub: MPI.Comm,
    name: str,
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    timeout: float,
    case: _OptimizerCase,
    drawn: str = "",
) -> str | None:
    """What breaks exercise 13.3's contract for one optimizer and dtype, or None (drawn: the grader's case, named)."""
    rank, size = sub.Get_rank(), sub.Get_size()
    batches = _optimizer_batches(size, dtype, case)
    reference = _optimizer_model(dtype, case)
    inner = optimizer_class(reference.parameters(), **kwargs)
    for x, y in batches:
        inner.zero_grad()
        (reference(x) - y).square().mean().backward()
        inner.step()
    model = _optimizer_model(dtype, case)
    params = list(model.parameters())
    changed: list[str] = []
    mine = slice(case.samples * rank, case.samples * (rank + 1))

    def train(comm: Comm) -> Any:
        optimizer = fn(params, optimizer_class, comm, **kwargs)
        for x, y in batches:
            optimizer.zero_grad()
            (model(x[mine]) - y[mine]).square().mean().backward()
            grads = [p.grad.clone() for p in params if p.grad is not None]
            optimizer.step()
            if not changed and (
                len(grads) != len(params)
                or any(p.grad is None or not torch.equal(p.grad, g) for p, g in zip(params, grads))
            ):
                changed.append(
                    "step() changed the parameters' .grad (or dropped it): divide a copy, leave autograd's gradients alone"
                )
        return optimizer

    context = f"ShardedOptimizer with {name} in {str(dtype).removeprefix('torch.')}{drawn}"
    optimizer, traffic = run_counted(
        sub, train, (), context, timeout=timeout, allow=("Allgather", "Allgatherv", "Reduce_scatter")
    )
    numel = sum(p.numel() for p in params)
    shard = -(-numel // size)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sent = _sent(traffic)
    if changed:
        return changed[0]
    if size > 1 and sent == 0:
        return (
            "nothing went through the communicator the check gave: use the `comm` argument (keep it), "
            "not the notebook's MPI.COMM_WORLD"
        )
    inner_optimizer = getattr(optimizer, "optimizer", None)
    if not isinstance(inner_optimizer, optimizer_class):
        return (
            f"keep the inner optimizer as `self.optimizer`, an instance of the class given ({optimizer_class.__name__})"
        )
    held_params = [p for group in inner_optimizer.param_groups for p in group["params"]]
    # the dtype before the values: a float32 flat buffer fails on values by rounding, which would mislead
    if any(p.dtype != dtype for p in held_params):
        return f"the inner optimizer's shard is {held_params[0].dtype}, the parameters {dtype}: make the flat buffers in the parameters' dtype"
    for p, (pname, want) in zip(params, reference.named_parameters()):
        if p.dtype != dtype:
            return f"parameter {pname} became {p.dtype}, the model's are {dtype}: copy the gathered values into the parameters"
        error = float((p.detach() - want.detach()).abs().max() / want.detach().abs().max())
        if not error <= OPTIMIZER_TOLERANCE[dtype]:
            return (
                f"after {OPTIMIZER_STEPS} steps parameter {pname} differs from one process's by {error:.1e} (relative): "
                "step the inner optimizer on the mean of the ranks' gradients (the reduce-scatter's sum over P), "
                "then allgather every shard into every rank's parameters"
            )
    held = sum(p.numel() for p in held_params)
    if held > shard:
        return (
            f"the inner optimizer holds {held} items of the {numel}, its state as much: build it over this "
            f"rank's shard only (at most ceil({numel}/{size}) = {shard} items), so its state is 1/P of data parallelism's"
        )
    limit = OPTIMIZER_STEPS * size * 2 * (size - 1) * shard * itemsize
    if sent > limit * BYTES_SLACK + 64 * OPTIMIZER_STEPS * size:
        return (
            f"the ranks sent {sent} bytes in {OPTIMIZER_STEPS} steps, a reduce-scatter and an allgather of the flat "
            f"buffer per step send {limit}: send shards, not whole gradients"
        )
    return None


def check_sharded_optimizer(fn: Callable[..., Any], timeout: float = 10.0) -> None:
    """fn(params, optimizer_class, comm, **kwargs) -> an object with zero_grad() and step(): ZeRO-1.

    `params` are alike on every rank; each rank builds `optimizer_class` (kept as `.optimizer`) over its
    own flat shard only; step() reduce-scatters the gradients, divides by P, steps the inner optimizer,
    allgathers the shards into the parameters. Run with SGD with momentum and Adam, in float64 and
    float32, on comm's size first then 1, 2, ...: equal to one process on the global batch (float64
    1e-10), the gradients left alone, the inner optimizer over at most ceil(N/P) items in the
    parameters' dtype, messages on the communicator given (MPI's Reduce_scatter and
    Allgather(v) allowed, within one ring reduce-scatter and allgather per step), each run done within
    `timeout` seconds.

    The grader's draw: the ranks of each communicator (any of the world's, in any order), two of the
    element-wise optimizers SGD, Adam, AdamW, RMSprop and Adagrad with drawn hyper-parameters, the model's
    widths (4 to 63 parameters), the samples per rank (1 to 4) and the data; float64 and float32.
    """
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "sharded_optimizer")
    optimizers = OPTIMIZERS if draw is None else _drawn_optimizers(draw)

    def body(sub: MPI.Comm) -> str | None:
        case = _optimizer_case(sub.Get_size(), draw)
        for name, optimizer_class, kwargs in optimizers:
            for dtype in (torch.float64, torch.float32):
                drawn = "" if draw is None else f", {case}{named(draw)}"
                problem = _optimizer_problem(fn, sub, name, optimizer_class, kwargs, dtype, timeout, case, drawn)
                where = f"{name}, {str(dtype).removeprefix('torch.')}{drawn}"
                fail_together(sub, problem and f"{where}: {problem}", "ShardedOptimizer")
        return None

    size = comm.Get_size()
    each_size(comm, body, "ShardedOptimizer", sizes=[size, *range(1, size)], draw=draw)
    said = "SGD with momentum and Adam" if draw is None else " and ".join(name for name, _, _ in optimizers)
    passed(
        comm,
        f"ShardedOptimizer: {said} on 1/P of the state each reach one process's parameters, "
        f"float64 and float32{named(draw)}",
    )


@dataclass(frozen=True)
class _Units:
    """Exercises 13.4 and 13.5's model: three Linear units, widths[i] -> widths[i + 1], unit i with a bias if
    biases[i]; `samples` per rank and step; the grader's data seed (None: the notebook's fixed seeds)."""

    widths: tuple[int, ...] = (5, 4, 4, 2)
    biases: tuple[bool, ...] = (True, True, True)
    samples: int = 3
    seed: int | None = None

    def model(self, between: type[nn.Module], dtype: torch.dtype, seed: int, draw_dtype: torch.dtype) -> nn.Sequential:
        """The units with `between` after each but the last, their parameters drawn (in draw_dtype) from `seed`
        (the notebook's) or the case's."""
        layers: list[nn.Module] = []
        for i, bias in enumerate(self.biases):
            layers += [nn.Linear(self.widths[i], self.widths[i + 1], bias=bias), between()]
        model = nn.Sequential(*layers[:-1]).to(dtype)
        generator = torch.Generator().manual_seed(seed if self.seed is None else self.seed)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=generator, dtype=draw_dtype))
        return model

    def __str__(self) -> str:
        units = ", ".join(
            f"Linear({self.widths[i]}, {self.widths[i + 1]}{'' if bias else ', bias=False'})"
            for i, bias in enumerate(self.biases)
        )
        return f"units {units}, {count(self.samples, 'sample')} per rank, data seed {self.seed}"


def _units(size: int, draw: Draw | None) -> _Units:
    """The notebook's units, or the grader's: widths 1 to 6, biases drawn, one unit always without one (a unit of
    a single parameter tensor, which the notebook never shows), 1 to 4 samples per rank, a data seed."""
    if draw is None:
        return _Units()
    widths = tuple(draw.integer(1, 6, "width", size, i) for i in range(4))
    biases = [bool(draw.integer(0, 1, "bias", size, i)) for i in range(3)]
    biases[draw.integer(0, 2, "no bias", size)] = False
    return _Units(widths, tuple(biases), draw.integer(1, 4, "samples", size), draw.data_seed("units", size))


def _zero2_model(dtype: torch.dtype, units: _Units) -> nn.Sequential:
    """Three Linear units with tanh between (the notebook's 5 -> 4 -> 4 -> 2: 24, 20 and 10 parameters)."""
    return units.model(nn.Tanh, dtype, 132, dtype)


def _zero2_problem(
    fn: Callable[..., Any], sub: MPI.Comm, dtype: torch.dtype, timeout: float, case: _Units, context: str
) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    generator = torch.Generator().manual_seed(1000 * size + rank + (0 if case.seed is None else case.seed))
    n, a, b = case.samples, case.widths[0], case.widths[-1]
    batches = [
        (torch.randn(n, a, generator=generator, dtype=dtype), torch.randn(n, b, generator=generator, dtype=dtype))
        for _ in range(2)
    ]
    model = _zero2_model(dtype, case)
    units = [model[0], model[2], model[4]]
    kept: list[list[tuple[int, Any]]] = []
    problems: list[str] = []

    def train(comm: Comm) -> None:
        for index, unit in enumerate(units):
            fn(unit, comm, lambda shard, index=index: kept[-1].append((index, shard)))
            params = list(unit.parameters())
            arrived: list[int] = []
            early: list[int] = []  # how many of the unit's gradients had arrived when its first keep() came

            def watch(
                param: torch.Tensor,
                index: int = index,
                params: list = params,
                arrived: list = arrived,
                early: list = early,
            ) -> None:
                arrived.append(1)
                if not early and any(i == index for i, _ in kept[-1]):
                    early.append(len(arrived))
                if len(arrived) < len(params):
                    return
                arrived.clear()
                times, first = sum(i == index for i, _ in kept[-1]), early[:1]
                early.clear()
                if not problems and any(p.grad is not None for p in params):
                    problems.append(
                        f"unit {index}'s full gradient is still held once its backward is over: set each "
                        "parameter's .grad to None after the reduce-scatter (only the shard should stay)"
                    )
                if not problems and (times > 1 or (first and first[0] < len(params))):
                    problems.append(
                        f"unit {index} was reduce-scattered {times} time{'s' * (times != 1)} in one backward, the "
                        f"first after {first[0]} of its {len(params)} gradients had arrived: reduce-scatter once, "
                        "in the hook that sees the unit's last gradient (count the arrivals)"
                    )
                if not problems and [i for i, _ in kept[-1]] != [i for i in range(index, len(units))][::-1]:
                    problems.append(
                        f"unit {index}'s shard was not kept when its last gradient arrived: reduce-scatter in the "
                        "post-accumulate-grad hook of the unit's last gradient, once per backward"
                    )

            for p in params:
                p.register_post_accumulate_grad_hook(watch)
        for x, y in batches:
            kept.append([])
            (model(x) - y).square().mean().backward()

    _, traffic = run_counted(
        sub,
        train,
        (),
        context,
        timeout=timeout,
        allow=("Reduce_scatter",),
    )
    # one process's mean shards, before any verdict: every rank takes every Allreduce, whichever ranks'
    # shards turn out wrong (a rank whose shard is all padding can be right where another is not)
    reference = _zero2_model(dtype, case)
    wants: list[list[np.ndarray]] = []
    for x, y in batches:
        reference.zero_grad()
        (reference(x) - y).square().mean().backward()
        wants.append([])
        for unit in [reference[0], reference[2], reference[4]]:
            flat = torch.cat([p.grad.reshape(-1) for p in unit.parameters() if p.grad is not None])
            shard = -(-flat.numel() // size)
            padded = torch.zeros(shard * size, dtype=dtype)
            padded[: flat.numel()] = flat
            total = padded.numpy().copy()
            sub.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
            wants[-1].append(total[rank * shard : (rank + 1) * shard] / size)
    if problems:
        return problems[0]
    if size > 1 and _sent(traffic) == 0:
        return (
            "nothing went through the communicator the check gave: reduce-scatter on the `comm` argument, "
            "not the notebook's MPI.COMM_WORLD"
        )
    if len(kept) == 2 and all(len(k) == len(units) for k in kept):
        firsts, seconds = dict(kept[0]), dict(kept[1])
        if any(
            isinstance(firsts.get(i), torch.Tensor)
            and isinstance(seconds.get(i), torch.Tensor)
            and firsts[i].untyped_storage().data_ptr() == seconds[i].untyped_storage().data_ptr()
            for i in firsts
        ):
            return "the second backward's shard is the first's buffer, overwritten: keep a new tensor each time"
    for step in range(len(batches)):
        got = dict(kept[step])
        if len(kept[step]) != len(units) or set(got) != set(range(len(units))):
            return f"step {step}: keep was called for units {[i for i, _ in kept[step]]}: once per unit and backward"
        for index, want in enumerate(wants[step]):
            shard_got = got[index]
            if not isinstance(shard_got, torch.Tensor):
                return f"unit {index}: keep() got a {type(shard_got).__name__}, pass it a tensor"
            scale = max(1.0, float(np.abs(want).max(initial=0.0)))  # rounding grows with the largest terms
            problem = array_problem(
                shard_got.detach().numpy(),
                want.astype(shard_got.detach().numpy().dtype),
                f"step {step}, unit {index}'s shard",
                rtol=1e-10 if dtype == torch.float64 else 1e-5,
                atol=(1e-12 if dtype == torch.float64 else 1e-6) * scale,
            )
            if problem is None and shard_got.dtype != dtype:
                problem = f"unit {index}'s shard is {shard_got.dtype}, its gradients {dtype}: make the flat buffer in the gradients' dtype"
            if problem:
                return problem + " (the mean over ranks of shard r of the unit's flat, zero-padded gradient)"
    return None


def check_zero2_hooks(fn: Callable[..., Any], timeout: float = 10.0) -> None:
    """fn(unit, comm, keep) installs post-accumulate-grad hooks on `unit` (an nn.Module): when the last of the
    unit's gradients of a backward has arrived, its flat zero-padded gradient is reduce-scattered over
    `comm` (P equal shards), keep(mean shard) is called with a new tensor in the gradients' dtype, and
    every parameter's .grad is set to None before the next unit's backward.

    Three Linear units, two backward passes, float64 and float32, on comm's size then 1, 2, ...;
    MPI's Reduce_scatter or point-to-point on the comm given; each run within `timeout` seconds.

    The grader's draw: the ranks of each communicator (any of the world's, in any order), the units' widths
    (1 to 6) and biases (one unit always without: one parameter tensor, where the notebook's have two), the
    samples per rank (1 to 4) and the data; float64 and float32.
    """
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "zero2_hooks")

    def body(sub: MPI.Comm) -> str | None:
        case = _units(sub.Get_size(), draw)
        for dtype in (torch.float64, torch.float32):
            where = str(dtype).removeprefix("torch.") + ("" if draw is None else f", {case}{named(draw)}")
            problem = _zero2_problem(fn, sub, dtype, timeout, case, f"zero2_hooks in {where}")
            fail_together(sub, problem and f"{where}: {problem}", "zero2_hooks")
        return None

    size = comm.Get_size()
    each_size(comm, body, "zero2_hooks", sizes=[size, *range(1, size)], draw=draw)
    passed(comm, f"zero2_hooks: each unit's gradient is reduce-scattered as its backward ends, and freed{named(draw)}")


def _reference_shard(flat: np.ndarray, size: int, rank: int) -> np.ndarray:
    shard = max(1, -(-flat.size // size))
    padded = np.zeros(shard * size, dtype=flat.dtype)
    padded[: flat.size] = flat
    return padded[rank * shard : (rank + 1) * shard].copy()


#: What a checkpoint's shards hold, dtype by dtype: float64 and float32 masters and Adam's moments, and a
#: bfloat16 model's shards as their int16 bits (NumPy has no bfloat16); with the value marking the old padding.
RESHARD_DTYPES: dict[type, float] = {np.float64: 7e7, np.float32: 7e7, np.int16: 7777}
#: The notebook's units (their items) and rank counts: each count's shards cut from the previous count's.
RESHARD_NUMELS = (10, 12, 2, 7, 1)
RESHARD_COUNTS = (4, 2, 3, 1, 4, 5)


@dataclass(frozen=True)
class _ReshardCase:
    """Exercise 13.6's cases: units of `numels` items, resharded along `counts` ranks, the old padding holding
    `markers[dtype]`; the grader's data seed (None: the notebook's)."""

    numels: tuple[int, ...] = RESHARD_NUMELS
    counts: tuple[int, ...] = RESHARD_COUNTS
    markers: tuple[tuple[type, float], ...] = tuple(RESHARD_DTYPES.items())
    seed: int | None = None

    def __str__(self) -> str:
        markers = ", ".join(f"{np.dtype(d).name} {m:g}" for d, m in self.markers)
        chain = " -> ".join(map(str, self.counts))
        return (
            f"units of {list(self.numels)} items along {chain} ranks, padding marked {markers}, data seed {self.seed}"
        )


def _reshard_case(draw: Draw | None) -> _ReshardCase:
    """The notebook's, or the grader's: 5 units of 1 to 40 items, 6 rank counts of 1 to 8, markers and data."""
    if draw is None:
        return _ReshardCase()
    rng = draw.rng("markers")
    markers = (
        (np.float64, float(rng.uniform(1, 1e8)) * float(rng.choice([-1, 1]))),
        (np.float32, float(np.float32(rng.uniform(1, 1e6))) * float(rng.choice([-1, 1]))),
        (np.int16, float(rng.integers(1, 32767)) * float(rng.choice([-1, 1]))),
    )
    order = draw.rng("numels").permutation(5)
    numels = draw.lengths(5, 1, 40, "numels")
    return _ReshardCase(
        tuple(numels[i] for i in order),
        tuple(draw.integer(1, 8, "counts", i) for i in range(6)),
        markers,
        draw.data_seed("reshard"),
    )


def _dtype_name(dtype: type) -> str:
    return f"{np.dtype(dtype).name}{' = bfloat16 bits' if dtype == np.int16 else ''}"


def _reshard_problem(
    fn: Callable[[list[np.ndarray], int, int, int], np.ndarray], dtype: type, marker: float, case: _ReshardCase
) -> str | None:
    """The first wrong shard along the case's rank counts (4 -> 2 -> 3 -> 1 -> 4 -> 5) for its units, or None."""
    for numel in case.numels:
        generator = np.random.default_rng(numel if case.seed is None else [case.seed, numel])
        flat: np.ndarray = (100 * generator.standard_normal(numel)).astype(dtype)
        shards = [_reference_shard(flat, case.counts[0], q) for q in range(case.counts[0])]
        for size in case.counts[1:]:  # each count from the previous count's shards
            old_shard = shards[0].size
            for q, shard in enumerate(shards):  # mark the old padding: it must not reach the new shards
                shard[max(0, numel - q * old_shard) :] = marker
            new = []
            for rank in range(size):
                context = (
                    f"reshard of {numel} items ({_dtype_name(dtype)}) from {len(shards)} to {size} ranks, rank {rank}"
                )
                given = [s.copy() for s in shards]
                got = fn(given, numel, size, rank)
                problem = array_problem(got, _reference_shard(flat, size, rank), "the new shard")
                if problem is None and any(np.shares_memory(got, s) for s in given):
                    problem = "the new shard shares memory with an old one: return a new array"
                if problem is None and any(not np.array_equal(a, b) for a, b in zip(given, shards)):
                    problem = "the old shards were changed: read them, do not write them"
                if problem:
                    return f"{context}: {problem}"
                new.append(got)
            for rank, got in enumerate(new):  # a later call must not have changed an earlier call's result
                if not np.array_equal(got, _reference_shard(flat, size, rank)) or any(
                    np.shares_memory(got, other) for other in new[rank + 1 :]
                ):
                    return (
                        f"reshard of {numel} items ({_dtype_name(dtype)}) from {len(shards)} to {size} ranks: "
                        f"rank {rank}'s new shard changed when a later rank's was made: return a new array on "
                        "every call, not a buffer reused across calls"
                    )
            shards = new
    return None


def check_reshard(fn: Callable[[list[np.ndarray], int, int, int], np.ndarray]) -> None:
    """fn(shards, numel, size, rank) -> rank's shard when `numel` items are cut for `size` ranks.

    `shards` are the equal padded shards another rank count wrote (their padding is not
    zero here: it is nothing the new shard may copy), in every dtype a checkpoint holds:
    float64, float32, and bfloat16 as int16 bits. Each call must return a new array in the
    shards' dtype, leave the old shards alone, and stay unchanged by later calls.

    The grader's draw: 5 units of 1 to 40 items, a chain of 6 rank counts of 1 to 8 (the first writes,
    each next reads the previous one's shards), the values marking the old padding and the data; the three
    dtypes. Every rank draws rank 0's (a collective on MPI.COMM_WORLD: the notebook runs it on every engine).
    """
    draw = grading_draw(MPI.COMM_WORLD, "reshard")
    case = _reshard_case(draw)
    for dtype, marker in case.markers:
        problem = _reshard_problem(fn, dtype, marker, case)
        if problem:
            raise CheckFailed(
                problem
                + ("" if draw is None else f" ({case}{named(draw)})")
                + "\n(new rank r holds items [r s, (r+1) s) of the flat buffer, "
                "s = ceil(numel / size), in the shards' dtype; copy the overlapping pieces of the old "
                "shards, items past numel are zeros)"
            )
    # every rank ran the same cases, so all fail or pass alike; one line says so, from rank 0
    chain = " -> ".join(map(str, case.counts))
    passed(
        MPI.COMM_WORLD,
        f"reshard cuts a checkpoint's shards for any rank count, {chain}, padding zeros, "
        f"float64, float32 and bfloat16 bits{named(draw)}",
    )


#: The dtypes exercise 13.5's unit runs in (the master dtypes: mixed precision's bfloat16 copies are the library's
#: `Sharded(param_dtype=...)`), and the relative tolerance of its gradient shards against one process's.
ZERO3_DTYPES = {torch.float64: 1e-10, torch.float32: 1e-5}
ZERO3_STEPS = 2
#: The check's own optimizer step on the shards (plain SGD: element-wise, so a shard steps as the whole would).
ZERO3_LR = 0.1
#: torch warns, on every rank, when a full backward (pre-)hook fires on a unit whose inputs need no
#: gradient (the first unit): harmless for a valid answer that regathers there, so the check hides it.
FULL_BACKWARD_HOOK_NOTE = "Full backward hook is firing when gradients are computed with respect to module outputs"


def _zero3_model(dtype: torch.dtype, units: _Units) -> nn.Sequential:
    """Three Linear units with ReLU between (the notebook's 5 -> 4 -> 4 -> 2: 24, 20 and 10 parameters, which
    3 ranks must pad)."""
    return units.model(nn.ReLU, dtype, 13, torch.float64)


def _zero3_batches(size: int, dtype: torch.dtype, units: _Units) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch of `units.samples` samples per rank for each step."""
    generator = torch.Generator().manual_seed(130 + size + (0 if units.seed is None else units.seed))
    n, a, b = units.samples * size, units.widths[0], units.widths[-1]
    return [
        (
            torch.randn(n, a, generator=generator, dtype=torch.float64).to(dtype),
            torch.randn(n, b, generator=generator, dtype=torch.float64).to(dtype),
        )
        for _ in range(ZERO3_STEPS)
    ]


def _zero3_reference(
    size: int, dtype: torch.dtype, units: _Units
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """One process on the global batch: per step, each unit's flat parameters before it and flat mean gradient."""
    model = _zero3_model(dtype, units)
    layers = [model[0], model[2], model[4]]
    steps = []
    for x, y in _zero3_batches(size, dtype, units):
        values = [torch.cat([p.detach().reshape(-1) for p in unit.parameters()]) for unit in layers]
        model.zero_grad()
        (model(x) - y).square().mean().backward()
        grads = [torch.cat([p.grad.reshape(-1) for p in unit.parameters() if p.grad is not None]) for unit in layers]
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                p.sub_(ZERO3_LR * p.grad)
        steps.append((values, grads))
    return steps


def _held(tensor: torch.Tensor) -> int:
    """The bytes of a tensor's storage (0 once freed); reading a freed tensor's values would crash."""
    return int(tensor.untyped_storage().nbytes())


class _Zero3Watch:
    """The check's own hooks on one unit of exercise 13.5, placed after the answer's: what it holds, when."""

    def __init__(
        self, index: int, module: nn.Module, shapes: list[torch.Size], shard: Any, shard_numel: int, dtype: torch.dtype
    ):
        self.index, self.module, self.shard = index, module, shard
        self.params, self.shapes = list(module.parameters()), shapes
        self.shard_numel, self.dtype = shard_numel, dtype
        self.want: torch.Tensor | None = None  # this step's flat parameters, one process's
        self.saved: list[torch.Tensor] = []  # what autograd saved that viewed the gathered parameters
        self.step = 0

    def fail(self, text: str) -> None:
        raise CheckFailed(f"step {self.step}, unit {self.index}: {text}")

    def before_forward(self, module: nn.Module, args: Any) -> None:
        if any(
            p.shape != shape or _held(p) < p.numel() * p.element_size() for p, shape in zip(self.params, self.shapes)
        ):
            self.fail(
                "it computed its forward with its parameters freed: gather them into the flat buffer in a forward "
                "pre-hook (its storage back to full size first)"
            )
        got = torch.cat([p.detach().reshape(-1) for p in self.params])
        assert self.want is not None
        tolerance = ZERO3_DTYPES[self.dtype]
        scale = max(1.0, float(self.want.abs().max())) if self.want.numel() else 1.0
        if got.dtype != self.dtype or not torch.allclose(got, self.want, rtol=tolerance, atol=tolerance * scale):
            self.fail(
                "the parameters its forward computed with are not the shards' current values: gather every "
                "rank's shard (after the optimizer's step changed them) into the flat buffer the parameters view"
            )

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if any(_held(p) for p in self.params):
            self.fail(
                "its parameters still hold memory after its forward: free the flat buffer's storage "
                "(`untyped_storage().resize_(0)`) in a forward hook, so only the unit computing holds its parameters"
            )
        if any(_held(t) for t in self.saved):
            self.fail(
                "the tensors autograd saved for backward still hold the parameters' old memory after free: make "
                "the parameters views of one flat buffer (`p.data = view`) and shrink that buffer's storage, "
                "rather than giving the parameters new tensors"
            )

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """A saved-tensors pack hook: keep the tensors that share the gathered parameters' storage."""
        if _held(tensor) and any(
            _held(p) and tensor.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in self.params
        ):
            self.saved.append(tensor)
        return tensor

    def after_backward(self, want_grad: torch.Tensor, size: int, rank: int, earlier: list[torch.Tensor]) -> None:
        if any(_held(p) for p in self.params):
            self.fail(
                "its parameters still hold memory after backward: free the flat buffer once the gradient is reduced"
            )
        if any(p.grad is not None for p in self.params):
            self.fail(
                "its full gradient is still held after backward: set each parameter's .grad to None after the reduce-scatter"
            )
        grad = getattr(self.shard, "grad", None)
        if not isinstance(grad, torch.Tensor):
            self.fail("the shard's .grad is not set after backward: set it to this rank's shard of the mean gradient")
        assert isinstance(grad, torch.Tensor)
        if grad.shape != (self.shard_numel,) or grad.dtype != self.dtype:
            self.fail(
                f"the shard's .grad has shape {tuple(grad.shape)} and dtype {grad.dtype}, expected "
                f"({self.shard_numel},) and {self.dtype} (make the flat gradient buffer in the parameters' dtype)"
            )
        padded = torch.zeros(self.shard_numel * size, dtype=want_grad.dtype)
        padded[: want_grad.numel()] = want_grad
        want = padded[rank * self.shard_numel : (rank + 1) * self.shard_numel]
        scale = max(1.0, float(want.abs().max()))
        if float((grad.detach().double() - want.double()).abs().max()) > ZERO3_DTYPES[self.dtype] * scale:
            self.fail(
                "the shard's .grad is wrong: it must be this rank's shard of the mean over ranks of the unit's flat, "
                "zero-padded gradient (reduce-scatter the sum, then divide by P), made once the unit's last gradient "
                "has arrived"
            )
        if any(grad.untyped_storage().data_ptr() == e.untyped_storage().data_ptr() for e in earlier):
            self.fail(
                "the shard's .grad is the previous step's tensor, overwritten: make a new tensor each backward "
                "(the optimizer or the caller may still hold the last one)"
            )


def _zero3_problem(
    fn: Callable[..., Any], sub: MPI.Comm, dtype: torch.dtype, timeout: float, case: _Units, context: str
) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    batches = _zero3_batches(size, dtype, case)
    reference = _zero3_reference(size, dtype, case)
    model = _zero3_model(dtype, case)
    mine = slice(case.samples * rank, case.samples * (rank + 1))
    modules = [model[0], model[2], model[4]]
    numels = [sum(p.numel() for p in m.parameters()) for m in modules]
    shard_numels = [-(-n // size) for n in numels]

    def train(comm: Comm) -> None:
        watches = []
        for index, module in enumerate(modules):
            shapes = [p.shape for p in module.parameters()]
            shard = fn(module, comm)
            watches.append(_Zero3Watch(index, module, shapes, shard, shard_numels[index], dtype))
        problem = None
        for w in watches:
            if not isinstance(w.shard, torch.Tensor) or not w.shard.requires_grad:
                problem = f"unit {w.index}: return this rank's shard as an nn.Parameter (the optimizer steps it), got {type(w.shard).__name__}"
            elif w.shard.shape != (w.shard_numel,) or w.shard.dtype != dtype:
                problem = (
                    f"unit {w.index}: the shard has shape {tuple(w.shard.shape)} and dtype {w.shard.dtype}; a shard "
                    f"of {numels[w.index]} items over {size} ranks is ceil(N/P) = ({w.shard_numel},) items in the "
                    f"parameters' dtype {dtype} (pad the flat buffer with zeros to P equal shards)"
                )
            elif _held(w.shard) < w.shard_numel * w.shard.element_size():
                problem = (
                    f"unit {w.index}: the shard has no memory of its own: it views the flat buffer, whose storage "
                    "free() empties; keep a copy (`.clone()`) of this rank's slice"
                )
            elif any(_held(p) for p in w.params):
                problem = (
                    f"unit {w.index}: its parameters hold memory once zero3_unit has returned: free the flat buffer "
                    "(its storage resized to 0) until its forward gathers it"
                )
            if problem:
                break
        if any(sub.allgather(problem)):  # the same decision on every rank before any message of the answer's
            raise CheckFailed(problem or "another rank's shard is wrong (see its message)")
        for w in watches:
            w.module.register_forward_pre_hook(w.before_forward)
            w.module.register_forward_hook(w.after_forward)
        earlier: list[list[torch.Tensor]] = [[] for _ in watches]
        for step, (x, y) in enumerate(batches):
            for w, want in zip(watches, reference[step][0]):
                w.want, w.saved, w.step = want, [], step

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                for w in watches:
                    w.pack(tensor)
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out = model(x[mine])
            try:
                with warnings.catch_warnings():  # torch's note on a valid answer's full backward pre-hook
                    warnings.filterwarnings("ignore", message=FULL_BACKWARD_HOOK_NOTE)
                    (out - y[mine]).square().mean().backward()
            except RuntimeError as err:
                raise CheckFailed(
                    f"step {step}: backward failed ({err}): gather the unit again before its backward needs its "
                    "parameters (a hook on its output's gradient)"
                ) from None
            for index, w in enumerate(watches):
                w.after_backward(reference[step][1][index], size, rank, earlier[index])
            with torch.no_grad():
                for index, w in enumerate(watches):
                    earlier[index].append(w.shard.grad)
                    w.shard -= ZERO3_LR * w.shard.grad
                    w.shard.grad = None

    _, traffic = run_counted(
        sub,
        train,
        (),
        context,
        timeout=timeout,
        allow=("Allgather", "Allgatherv", "Reduce_scatter"),
    )
    sent = _sent(traffic)
    if size > 1 and sent == 0:
        return (
            "nothing went through the communicator the check gave: gather and reduce-scatter on the `comm` "
            "argument, not the notebook's MPI.COMM_WORLD"
        )
    itemsize = torch.empty((), dtype=dtype).element_size()
    limit = ZERO3_STEPS * 3 * size * (size - 1) * sum(shard_numels) * itemsize  # 2 allgathers, 1 reduce-scatter
    if sent > limit * BYTES_SLACK + 64 * ZERO3_STEPS * size:
        return (
            f"the ranks sent {sent} bytes in {ZERO3_STEPS} steps; two allgathers and one reduce-scatter of each "
            f"unit's shards per step send {limit}: gather once before forward and once before backward, "
            "reduce once per backward, and send shards, not whole buffers"
        )
    return None


def check_zero3_unit(fn: Callable[..., Any], timeout: float = 10.0) -> None:
    """fn(unit, comm) -> shard: ZeRO-3's core for one unit (an nn.Module), built by the answer.

    fn lays the unit's parameters end to end in one flat buffer zero-padded to P equal shards of
    s = ceil(N/P) items (the parameters' dtype), makes every parameter a view of it, keeps this rank's
    slice as a new nn.Parameter `shard` (returned), frees the buffer's storage, and installs hooks:
    gather every rank's shard into the buffer (its storage back) before the unit's forward, free it
    after; gather again before its backward; once all of its gradients have arrived, reduce-scatter the
    flat zero-padded gradient over `comm`, set `shard.grad` to this rank's shard of the mean (a new tensor),
    set every parameter's `.grad` to None and free the buffer.

    Three Linear units, two steps of forward, backward and the check's SGD step on the shards, float64 and
    float32, on comm's size first then 1, 2, ...: what each unit holds before, during and after its
    forward and backward (the storage's bytes, and the tensors autograd saved), the values it computes
    with, the gradient shards against one process on the global batch, messages on the comm given
    (MPI's Allgather(v) and Reduce_scatter allowed) within two allgathers and one reduce-scatter
    per unit and step, each run within `timeout` seconds.

    The grader's draw: the ranks of each smaller communicator (any of the world's, in any order; the whole
    world runs first in its own order), the units' widths (1 to 6) and biases (one unit always without: one
    parameter tensor, where the notebook's have two), the samples per rank (1 to 4) and the data; float64
    and float32.
    """
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "zero3_unit")

    def body(sub: MPI.Comm) -> str | None:
        case = _units(sub.Get_size(), draw)
        for dtype in ZERO3_DTYPES:
            where = str(dtype).removeprefix("torch.") + ("" if draw is None else f", {case}{named(draw)}")
            problem = _zero3_problem(fn, sub, dtype, timeout, case, f"zero3_unit in {where}")
            fail_together(sub, problem and f"{where}: {problem}", "zero3_unit")
        return None

    size = comm.Get_size()
    # comm's own size first with its ranks in order, drawn or not: the check's hooks fail a unit on the ranks
    # that see it wrong, mid-forward, so an answer on the notebook's MPI.COMM_WORLD must complete there (and fail
    # for sending nothing on comm) before a drawn communicator would leave the other ranks in its world messages
    each_size(comm, body, "zero3_unit", sizes=[size])
    each_size(comm, body, "zero3_unit", sizes=range(1, size), draw=draw)
    passed(
        comm,
        "zero3_unit: each unit holds its parameters only while it computes (autograd's saved tensors too), "
        f"and its shard's gradient is the mean of the ranks', in float64 and float32{named(draw)}",
    )
