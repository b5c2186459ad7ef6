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
"""

from __future__ import annotations

import warnings
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


#: The dtypes exercise 13.5's unit runs in (the master dtypes: mixed precision's bfloat16 copies are the library's
#: `Sharded(param_dtype=...)`), and the relative tolerance of its gradient shards against one process's.
ZERO3_DTYPES = {torch.float64: 1e-10, torch.float32: 1e-5}
ZERO3_STEPS = 2
#: The check's own optimizer step on the shards (plain SGD: element-wise, so a shard steps as the whole would).
ZERO3_LR = 0.1
#: torch warns, on every rank, when a full backward (pre-)hook fires on a unit whose inputs need no
#: gradient (the first unit): harmless for a valid answer that regathers there, so the check hides it.
FULL_BACKWARD_HOOK_NOTE = "Full backward hook is firing when gradients are computed with respect to module outputs"


def _zero3_model(dtype: torch.dtype) -> nn.Sequential:
    """Three Linear units (5 -> 4 -> 4 -> 2, ReLU between): 24, 20 and 10 parameters (3 ranks need padding)."""
    generator = torch.Generator().manual_seed(13)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))
    return model


def _zero3_batches(size: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch of 3 samples per rank for each step."""
    generator = torch.Generator().manual_seed(130 + size)
    return [
        (
            torch.randn(3 * size, 5, generator=generator, dtype=torch.float64).to(dtype),
            torch.randn(3 * size, 2, generator=generator, dtype=torch.float64).to(dtype),
        )
        for _ in range(ZERO3_STEPS)
    ]


def _zero3_reference(size: int, dtype: torch.dtype) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """One process on the global batch: per step, each unit's flat parameters before it and flat mean gradient."""
    model = _zero3_model(dtype)
    units = [model[0], model[2], model[4]]
    steps = []
    for x, y in _zero3_batches(size, dtype):
        values = [torch.cat([p.detach().reshape(-1) for p in unit.parameters()]) for unit in units]
        model.zero_grad()
        (model(x) - y).square().mean().backward()
        grads = [torch.cat([p.grad.reshape(-1) for p in unit.parameters() if p.grad is not None]) for unit in units]
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
        if got.dtype != self.dtype or not torch.allclose(got, self.want, rtol=ZERO3_DTYPES[self.dtype], atol=0):
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


def _zero3_problem(fn: Callable[..., Any], sub: MPI.Comm, dtype: torch.dtype, timeout: float) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    batches = _zero3_batches(size, dtype)
    reference = _zero3_reference(size, dtype)
    model = _zero3_model(dtype)
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
                out = model(x[3 * rank : 3 * rank + 3])
            try:
                with warnings.catch_warnings():  # torch's note on a valid answer's full backward pre-hook
                    warnings.filterwarnings("ignore", message=FULL_BACKWARD_HOOK_NOTE)
                    (out - y[3 * rank : 3 * rank + 3]).square().mean().backward()
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
        f"zero3_unit in {str(dtype).removeprefix('torch.')}",
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
    """
    comm = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        for dtype in ZERO3_DTYPES:
            problem = _zero3_problem(fn, sub, dtype, timeout)
            fail_together(sub, problem and f"{str(dtype).removeprefix('torch.')}: {problem}", "zero3_unit")
        return None

    size = comm.Get_size()
    each_size(comm, body, "zero3_unit", sizes=[size, *range(1, size)])
    passed(
        comm,
        "zero3_unit: each unit holds its parameters only while it computes (autograd's saved tensors too), "
        "and its shard's gradient is the mean of the ranks', in float64 and float32",
    )
