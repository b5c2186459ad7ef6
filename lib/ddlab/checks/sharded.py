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
- `check_zero3_unit(fn)`: fn(unit, gather, free, reduce) places a ZeRO-3 unit's hooks: gather
  before forward, free after, gather before backward, reduce and free once its gradients are all there;
  in float64, float32 and bfloat16, the hooks leaving the units' inputs, outputs and dtypes alone.
- `check_reshard(fn)`: fn(shards, numel, size, rank) -> rank's shard of the flat buffer cut
  for `size` ranks, from the shards another rank count wrote (padding is zeros); float64, float32
  and bfloat16 bits, a new array in the shards' dtype on every call, the old shards left alone.

Bounds come as the flat space of lab 13 cuts them (equal shards) and unevenly: a short
last shard, and a rank with an empty one, so an answer that assumes equal shards fails.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from ..allreduce import allgather_ring, reduce_scatter_ring
from ..runtime.blocks import block_bounds
from ..runtime.comm import Comm
from ..runtime.counting import Traffic
from ._core import NOTHING_SENT, array_problem, each_size, fail_together, passed, reordered_hint, run_counted
from .errors import CheckFailed

#: Slack over the ring's bytes (the ring is optimal up to message boundaries).
BYTES_SLACK = 1.05


def _cases(size: int) -> list[tuple[str, list[int]]]:
    """(description, bounds) for a communicator of `size` ranks."""
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
    """fn(comm, x, bounds) -> new array: the sum over ranks of x[bounds[r]:bounds[r+1]] on rank r."""
    comm = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        for description, bounds in _cases(size):
            for dtype in (np.float64, np.float32):
                context = f"reduce_scatter ({description}, {np.dtype(dtype).name})"
                x = np.random.default_rng([bounds[-1], rank]).integers(-9, 9, bounds[-1]).astype(dtype)
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
                fail_together(sub, found and f"{context}: {found}", "reduce_scatter", reordered_hint(sub, comm))
        return None

    each_size(comm, body, "reduce_scatter", sizes=[comm.Get_size(), *range(1, comm.Get_size())], reordered=True)
    passed(comm, "reduce_scatter: each rank gets the sums of its own shard, equal or uneven, in the ring's bytes")


#: What the trainer hands allgather, case by case: float64 and float32 parameters, and bfloat16 ones
#: as their int16 bits (NumPy has no bfloat16). Four layouts, so each dtype meets an uneven one.
ALLGATHER_DTYPES = (np.float64, np.int16, np.float32, np.int16)


def check_allgather(fn: Callable[[Any, np.ndarray, list[int]], np.ndarray]) -> None:
    """fn(comm, mine, bounds) -> new array of bounds[-1] items, rank q's piece at bounds[q]:bounds[q+1]."""
    comm = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        for (description, bounds), dtype in zip(_cases(size), ALLGATHER_DTYPES):
            context = (
                f"allgather ({description}, {np.dtype(dtype).name}{' = bfloat16 bits' if dtype == np.int16 else ''})"
            )
            results, wants = [], []
            for call in range(2):  # two calls: the first result must survive the second
                full = (100 * np.random.default_rng([bounds[-1], call]).standard_normal(bounds[-1])).astype(dtype)
                mine = full[bounds[rank] : bounds[rank + 1]].copy()
                got, traffic = run_counted(sub, fn, (mine, list(bounds)), context)
                _, reference = run_counted(sub, allgather_ring, (mine.copy(), list(bounds)), "the reference")
                problem = array_problem(got, full, "the gathered buffer")
                if problem is None and np.shares_memory(got, mine):
                    problem = "the result shares memory with `mine`: return a new array"
                found = problem or _bytes_problem(traffic, reference)
                fail_together(sub, found and f"{context}: {found}", "allgather", reordered_hint(sub, comm))
                results.append(got)
                wants.append(full)
            found = None
            if np.shares_memory(results[0], results[1]) or not np.array_equal(results[0], wants[0]):
                found = (
                    f"{context}: the second call changed the first call's result: each call must return a "
                    "new array (a buffer reused across calls overwrites the parameters a unit still uses)"
                )
            fail_together(sub, found, "allgather", reordered_hint(sub, comm))
        return None

    each_size(comm, body, "allgather", sizes=[comm.Get_size(), *range(1, comm.Get_size())], reordered=True)
    passed(comm, "allgather: every rank gets every shard, equal or uneven, in a new array, in the ring's bytes")


#: Exercise 13.3's inner optimizers: (name, class, keyword arguments).
OPTIMIZERS: list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]] = [
    ("SGD with momentum 0.9", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ("Adam", torch.optim.Adam, {"lr": 0.05, "weight_decay": 1e-3}),
]
OPTIMIZER_STEPS = 3
#: Relative tolerance against one process, per dtype (float64: the course's 1e-10).
OPTIMIZER_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}


def _optimizer_model(dtype: torch.dtype) -> nn.Sequential:
    """5 -> 4 -> 2 with a tanh: 34 parameters, which 3 and 4 ranks cannot split evenly (the shards need padding)."""
    generator = torch.Generator().manual_seed(133)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=dtype))
    return model


def _optimizer_batches(size: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch of 3 samples per rank for each step."""
    generator = torch.Generator().manual_seed(size)
    return [
        (
            torch.randn(3 * size, 5, generator=generator, dtype=dtype),
            torch.randn(3 * size, 2, generator=generator, dtype=dtype),
        )
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
) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    batches = _optimizer_batches(size, dtype)
    reference = _optimizer_model(dtype)
    inner = optimizer_class(reference.parameters(), **kwargs)
    for x, y in batches:
        inner.zero_grad()
        (reference(x) - y).square().mean().backward()
        inner.step()
    model = _optimizer_model(dtype)
    params = list(model.parameters())
    changed: list[str] = []

    def train(comm: Comm) -> Any:
        optimizer = fn(params, optimizer_class, comm, **kwargs)
        for x, y in batches:
            optimizer.zero_grad()
            (model(x[3 * rank : 3 * rank + 3]) - y[3 * rank : 3 * rank + 3]).square().mean().backward()
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

    context = f"ShardedOptimizer with {name} in {str(dtype).removeprefix('torch.')}"
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
    mine = [p for group in inner_optimizer.param_groups for p in group["params"]]
    # the dtype before the values: a float32 flat buffer fails on values by rounding, which would mislead
    if any(p.dtype != dtype for p in mine):
        return f"the inner optimizer's shard is {mine[0].dtype}, the parameters {dtype}: make the flat buffers in the parameters' dtype"
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
    held = sum(p.numel() for p in mine)
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
    """
    comm = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        for name, optimizer_class, kwargs in OPTIMIZERS:
            for dtype in (torch.float64, torch.float32):
                problem = _optimizer_problem(fn, sub, name, optimizer_class, kwargs, dtype, timeout)
                fail_together(
                    sub, problem and f"{name}, {str(dtype).removeprefix('torch.')}: {problem}", "ShardedOptimizer"
                )
        return None

    size = comm.Get_size()
    each_size(comm, body, "ShardedOptimizer", sizes=[size, *range(1, size)])
    passed(
        comm,
        "ShardedOptimizer: SGD with momentum and Adam on 1/P of the state each reach one process's parameters, "
        "float64 and float32",
    )


def _zero2_model(dtype: torch.dtype) -> nn.Sequential:
    """Three Linear units (5 -> 4 -> 4 -> 2) with tanh between: 24, 20 and 10 parameters."""
    generator = torch.Generator().manual_seed(132)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=dtype))
    return model


def _zero2_problem(fn: Callable[..., Any], sub: MPI.Comm, dtype: torch.dtype, timeout: float) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    generator = torch.Generator().manual_seed(1000 * size + rank)
    batches = [
        (torch.randn(3, 5, generator=generator, dtype=dtype), torch.randn(3, 2, generator=generator, dtype=dtype))
        for _ in range(2)
    ]
    model = _zero2_model(dtype)
    units = [model[0], model[2], model[4]]
    kept: list[list[tuple[int, Any]]] = []
    problems: list[str] = []

    def train(comm: Comm) -> None:
        for index, unit in enumerate(units):
            fn(unit, comm, lambda shard, index=index: kept[-1].append((index, shard)))
            params = list(unit.parameters())
            arrived: list[int] = []

            def watch(param: torch.Tensor, index: int = index, params: list = params, arrived: list = arrived) -> None:
                arrived.append(1)
                if len(arrived) < len(params):
                    return
                arrived.clear()
                if not problems and any(p.grad is not None for p in params):
                    problems.append(
                        f"unit {index}'s full gradient is still held once its backward is over: set each "
                        "parameter's .grad to None after the reduce-scatter (only the shard should stay)"
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
        f"zero2_hooks in {str(dtype).removeprefix('torch.')}",
        timeout=timeout,
        allow=("Reduce_scatter",),
    )
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
    reference = _zero2_model(dtype)
    for step, (x, y) in enumerate(batches):
        reference.zero_grad()
        (reference(x) - y).square().mean().backward()
        got = dict(kept[step])
        if len(kept[step]) != len(units) or set(got) != set(range(len(units))):
            return f"step {step}: keep was called for units {[i for i, _ in kept[step]]}: once per unit and backward"
        for index, unit in enumerate([reference[0], reference[2], reference[4]]):
            flat = torch.cat([p.grad.reshape(-1) for p in unit.parameters() if p.grad is not None])
            shard = -(-flat.numel() // size)
            padded = torch.zeros(shard * size, dtype=dtype)
            padded[: flat.numel()] = flat
            total = padded.numpy().copy()
            sub.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
            want = total[rank * shard : (rank + 1) * shard] / size
            shard_got = got[index]
            if not isinstance(shard_got, torch.Tensor):
                return f"unit {index}: keep() got a {type(shard_got).__name__}, pass it a tensor"
            problem = array_problem(
                shard_got.detach().numpy(),
                want.astype(shard_got.detach().numpy().dtype),
                f"step {step}, unit {index}'s shard",
                rtol=1e-10 if dtype == torch.float64 else 1e-5,
                atol=1e-12 if dtype == torch.float64 else 1e-6,
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
    """
    comm = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        for dtype in (torch.float64, torch.float32):
            problem = _zero2_problem(fn, sub, dtype, timeout)
            fail_together(sub, problem and f"{str(dtype).removeprefix('torch.')}: {problem}", "zero2_hooks")
        return None

    size = comm.Get_size()
    each_size(comm, body, "zero2_hooks", sizes=[size, *range(1, size)])
    passed(comm, "zero2_hooks: each unit's gradient is reduce-scattered as its backward ends, and freed")


def _reference_shard(flat: np.ndarray, size: int, rank: int) -> np.ndarray:
    shard = max(1, -(-flat.size // size))
    padded = np.zeros(shard * size, dtype=flat.dtype)
    padded[: flat.size] = flat
    return padded[rank * shard : (rank + 1) * shard].copy()


#: What a checkpoint's shards hold, dtype by dtype: float64 and float32 masters and Adam's moments, and a
#: bfloat16 model's shards as their int16 bits (NumPy has no bfloat16); with the value marking the old padding.
RESHARD_DTYPES: dict[type, float] = {np.float64: 7e7, np.float32: 7e7, np.int16: 7777}


def _dtype_name(dtype: type) -> str:
    return f"{np.dtype(dtype).name}{' = bfloat16 bits' if dtype == np.int16 else ''}"


def _reshard_problem(fn: Callable[[list[np.ndarray], int, int, int], np.ndarray], dtype: type) -> str | None:
    """The first wrong shard along 4 -> 2 -> 3 -> 1 -> 4 -> 5 ranks for units of several lengths, or None."""
    for numel in (10, 12, 2, 7, 1):
        flat: np.ndarray = (100 * np.random.default_rng(numel).standard_normal(numel)).astype(dtype)
        shards = [_reference_shard(flat, 4, q) for q in range(4)]
        for size in (2, 3, 1, 4, 5):  # 4 -> 2 -> 3 -> 1 ..., each from the previous count's shards
            old_shard = shards[0].size
            for q, shard in enumerate(shards):  # mark the old padding: it must not reach the new shards
                shard[max(0, numel - q * old_shard) :] = RESHARD_DTYPES[dtype]
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
    """
    for dtype in RESHARD_DTYPES:
        problem = _reshard_problem(fn, dtype)
        if problem:
            raise CheckFailed(
                problem + "\n(new rank r holds items [r s, (r+1) s) of the flat buffer, "
                "s = ceil(numel / size), in the shards' dtype; copy the overlapping pieces of the old "
                "shards, items past numel are zeros)"
            )
    # every rank ran the same cases, so all fail or pass alike; one line says so, from rank 0
    passed(
        MPI.COMM_WORLD,
        "reshard cuts a checkpoint's shards for any rank count, 4 -> 2 -> 3 -> 1 -> 4 -> 5, padding zeros, "
        "float64, float32 and bfloat16 bits",
    )


#: The dtypes the trainer runs a ZeRO-3 unit in: float64 and float32 (its master dtype) and bfloat16 (the
#: compute dtype of mixed precision); the gradients' relative tolerance against autograd's, per dtype.
ZERO3_DTYPES = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}


def _zero3_model(dtype: torch.dtype) -> nn.Sequential:
    generator = torch.Generator().manual_seed(13)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))
    return model


class _UnitLog:
    """What happened to one unit during a check of exercise 13.5: its gathers, frees and reductions."""

    def __init__(self, index: int, module: nn.Module, problems: list[str]):
        self.index, self.module, self.problems = index, module, problems
        self.params = list(module.parameters())
        self.values = [p.detach().clone() for p in self.params]
        self.gathered, self.reduced = True, 0
        self.calls: list[str] = []
        self.grads: list[torch.Tensor] = []

    def gather(self) -> None:
        self.calls.append("gather")
        if not self.gathered:
            with torch.no_grad():
                for p, value in zip(self.params, self.values):
                    p.untyped_storage().resize_(value.numel() * value.element_size())
                    p.data.copy_(value)  # .data: not a change autograd tracks (its saved views stay valid)
            self.gathered = True

    def free(self) -> None:
        self.calls.append("free")
        for p in self.params:
            p.untyped_storage().resize_(0)
        self.gathered = False

    def reduce(self) -> None:
        self.calls.append("reduce")
        missing = [tuple(p.shape) for p in self.params if p.grad is None]
        if missing and not self.problems:
            self.problems.append(
                f"unit {self.index}'s gradients were reduce-scattered before its backward ended "
                f"(no gradient yet for its {missing} parameters): reduce once every parameter of "
                "the unit has its gradient (count them in post-accumulate-grad hooks)"
            )
        self.reduced += 1
        self.grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for p in self.params:
            p.grad = None


def _zero3_problem(
    fn: Callable[[nn.Module, Callable[[], None], Callable[[], None], Callable[[], None]], Any], dtype: torch.dtype
) -> str | None:
    """Two steps of a three-unit model in `dtype` with fn's hooks, against autograd on a plain copy: the first problem."""
    name = str(dtype).removeprefix("torch.")
    inputs = [
        torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(3, 5).to(dtype),
        torch.linspace(2, -0.5, 15, dtype=torch.float64).reshape(3, 5).to(dtype),
    ]
    reference = _zero3_model(dtype)
    outputs, gradients = [], []
    for x in inputs:
        reference.zero_grad()
        out = reference(x)
        out.square().sum().backward()
        outputs.append(out.detach().clone())
        gradients.append(
            [
                [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in reference[2 * i].parameters()]
                for i in range(3)
            ]
        )
    problems: list[str] = []
    model = _zero3_model(dtype)
    units = [_UnitLog(i, model[2 * i], problems) for i in range(3)]
    for unit in units:
        unit.free()
        unit.calls.clear()
        fn(unit.module, unit.gather, unit.free, unit.reduce)
        unit.module.register_forward_pre_hook(
            lambda m, a, unit=unit: (
                None
                if unit.gathered or problems
                else problems.append(
                    f"unit {unit.index} computed its forward with its parameters freed: gather() in a forward pre-hook"
                )
            )
        )
        unit.module.register_forward_hook(
            lambda m, a, o, unit=unit: (
                None
                if not unit.gathered or problems
                else problems.append(
                    f"unit {unit.index}'s parameters were not freed after its forward: free() in a forward hook, so "
                    "only the unit that computes holds its full parameters"
                )
            )
        )
    rtol = ZERO3_DTYPES[dtype]
    for step, x in enumerate(inputs):
        for unit in units:
            unit.reduced = 0
        given = x.clone()
        try:
            output = model(given)
        except RuntimeError as err:
            return (
                f"{name}, step {step}: the forward failed ({err}): the hooks must leave the units' inputs and "
                "outputs as they are (in the units' dtype), returning nothing or what they were given"
            )
        if problems:
            return f"{name}: {problems[0]}"
        if not torch.equal(given, x):
            return f"{name}, step {step}: the model's input was changed in place by a hook: leave it alone"
        if not isinstance(output, torch.Tensor) or output.dtype != dtype:
            got = output.dtype if isinstance(output, torch.Tensor) else type(output).__name__
            return (
                f"{name}, step {step}: the model's output is {got}, its units compute in {dtype}: a hook made or "
                "cast a tensor in a fixed dtype; return nothing from the hooks (or what they were given)"
            )
        if not torch.allclose(output.detach(), outputs[step], rtol=rtol, atol=0):
            return f"{name}, step {step}: the model's output differs from the same model's without hooks"
        try:
            output.square().sum().backward()
        except RuntimeError as err:
            return (
                f"{name}, step {step}: backward failed ({err}): gather() the unit again before its backward needs "
                "its parameters, e.g. in a hook on its output's gradient, and return nothing from that hook (or "
                "the gradient it was given, in its dtype); a hook must not keep a tensor from one step to the "
                "next (a buffer reused across steps ties this step's graph to the last one's)"
            )
        for unit in units:
            if problems:
                break
            if unit.reduced != 1:
                problems.append(
                    f"step {step}: unit {unit.index}'s gradients were reduced {unit.reduced} times: "
                    "once per backward, when the last of its gradients has arrived"
                )
            elif unit.gathered:
                problems.append(
                    f"unit {unit.index} still holds its parameters after backward: free() it once its "
                    "gradients are reduced"
                )
            elif not all(
                g.dtype == dtype and torch.allclose(g, w, rtol=rtol, atol=0)
                for g, w in zip(unit.grads, gradients[step][unit.index])
            ):
                problems.append(f"step {step}: unit {unit.index}: the gradients reduce() saw differ from autograd's")
        if problems:
            return f"{name}: {problems[0]}"
    return None


def check_zero3_unit(
    fn: Callable[[nn.Module, Callable[[], None], Callable[[], None], Callable[[], None]], Any],
) -> None:
    """fn(unit, gather, free, reduce) installs hooks on `unit` (an nn.Module) so that, in every step,
    gather() runs before the unit's forward, free() right after it, gather() again before the
    unit's backward, and, once all of the unit's gradients exist, reduce() then free().

    The check wraps three Linear layers of a small model as units (its gather and free fill and
    empty the parameters' storage, its reduce records and clears the gradients), runs two steps
    of forward and backward on different inputs, in every dtype the trainer runs a unit in (float64,
    float32, bfloat16), and compares the output and the gradients reduce() saw with autograd's on a
    plain copy: a hook that changes a tensor's dtype, changes the input in place, or returns a buffer
    it reuses across steps fails.
    """
    for dtype in ZERO3_DTYPES:
        problem = _zero3_problem(fn, dtype)
        if problem:
            raise CheckFailed(problem)
    passed(
        MPI.COMM_WORLD,
        "zero3 hooks gather each unit before forward and backward, free it after, and reduce its "
        "gradients once they are complete, in float64, float32 and bfloat16",
    )
