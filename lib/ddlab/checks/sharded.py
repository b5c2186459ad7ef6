"""Checks of lab 13 (sharded data parallelism): the ring's two halves, and resharding a checkpoint.

- `check_reduce_scatter(fn)`: fn(comm, x, bounds) -> a new array, on rank r the sum over ranks
  of x[bounds[r]:bounds[r+1]]; point-to-point messages only; x left alone; no more bytes
  than the ring's reduce-scatter.
- `check_allgather(fn)`: fn(comm, mine, bounds) -> a new array of bounds[-1] items, rank q's
  `mine` at bounds[q]:bounds[q+1]; point-to-point only; each call a fresh array (the caller
  keeps it: a buffer reused by the next call would change it); no more bytes than the ring's.
- `check_zero2_step(fn)`: fn(comm, grad, params, momentum, lr) -> the new full parameters after one
  step of SGD with momentum on the mean gradient, each rank updating only its shard (momentum is
  this rank's shard, updated in place): a reduce-scatter, a shard update, an allgather.
- `check_zero3_unit(fn)`: fn(unit, gather, free, reduce) places a ZeRO-3 unit's hooks: gather
  before forward, free after, gather before backward, reduce and free once its gradients are all there.
- `check_reshard(fn)`: fn(shards, numel, size, rank) -> rank's shard of the flat buffer cut
  for `size` ranks, from the shards another rank count wrote (padding is zeros).

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
from ..runtime.counting import Traffic
from ._core import array_problem, each_size, fail_together, passed, run_counted
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
                fail_together(sub, found and f"{context}: {found}", "reduce_scatter")
        return None

    each_size(comm, body, "reduce_scatter")
    passed(comm, "reduce_scatter: each rank gets the sums of its own shard, equal or uneven, in the ring's bytes")


def check_allgather(fn: Callable[[Any, np.ndarray, list[int]], np.ndarray]) -> None:
    """fn(comm, mine, bounds) -> new array of bounds[-1] items, rank q's piece at bounds[q]:bounds[q+1]."""
    comm = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        for description, bounds in _cases(size):
            context = f"allgather ({description})"
            results, wants = [], []
            for call in range(2):  # two calls: the first result must survive the second
                full = np.random.default_rng([bounds[-1], call]).standard_normal(bounds[-1])
                mine = full[bounds[rank] : bounds[rank + 1]].copy()
                got, traffic = run_counted(sub, fn, (mine, list(bounds)), context)
                _, reference = run_counted(sub, allgather_ring, (mine.copy(), list(bounds)), "the reference")
                problem = array_problem(got, full, "the gathered buffer")
                if problem is None and np.shares_memory(got, mine):
                    problem = "the result shares memory with `mine`: return a new array"
                found = problem or _bytes_problem(traffic, reference)
                fail_together(sub, found and f"{context}: {found}", "allgather")
                results.append(got)
                wants.append(full)
            found = None
            if np.shares_memory(results[0], results[1]) or not np.array_equal(results[0], wants[0]):
                found = (
                    f"{context}: the second call changed the first call's result: each call must return a "
                    "new array (a buffer reused across calls overwrites the parameters a unit still uses)"
                )
            fail_together(sub, found, "allgather")
        return None

    each_size(comm, body, "allgather")
    passed(comm, "allgather: every rank gets every shard, equal or uneven, in a new array, in the ring's bytes")


#: The momentum coefficient of exercise 13.3's SGD.
MOMENTUM = 0.9


def check_zero2_step(fn: Callable[[Any, np.ndarray, np.ndarray, np.ndarray, float], np.ndarray]) -> None:
    """fn(comm, grad, params, momentum, lr) -> new full params; momentum (this rank's shard) updated in place.

    grad: this rank's full flat gradient, params: the full flat parameters (alike on every rank),
    both of P equal shards; with g the mean over ranks of grad's shard r, rank r sets
    momentum = 0.9 momentum + g and its shard of the parameters to params - lr momentum; every
    rank returns all the new shards in a new array. Messages: point-to-point only, no more bytes
    than one reduce-scatter and one allgather of the ring.
    """
    comm = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        for shard in (3, 1):
            n = shard * size
            context = f"zero2_step ({size} shards of {shard})"
            grad = np.random.default_rng([n, rank]).standard_normal(n)
            params = np.random.default_rng(n).standard_normal(n)
            momentum = np.random.default_rng([n, rank, 1]).standard_normal(shard)
            mean = np.empty_like(grad)
            sub.Allreduce(grad, mean, op=MPI.SUM)
            mean /= size
            mine = slice(rank * shard, (rank + 1) * shard)
            want_momentum = MOMENTUM * momentum + mean[mine]
            pieces = sub.allgather(params[mine] - 0.1 * want_momentum)
            given = (grad.copy(), params.copy(), momentum.copy())
            got, traffic = run_counted(sub, fn, (*given, 0.1), context)
            bounds = [q * shard for q in range(size + 1)]
            _, halves = run_counted(sub, reduce_scatter_ring, (grad.copy(), bounds), "the reference")
            _, gathered = run_counted(sub, allgather_ring, (params[mine].copy(), bounds), "the reference")
            problem = array_problem(got, np.concatenate(pieces), "the new parameters")
            if problem is None:
                problem = array_problem(given[2], want_momentum, "the momentum shard after the step")
                if problem:
                    problem += (
                        " (update it in place, momentum[...] = ..., with the mean gradient: the sum over "
                        "ranks divided by their number)"
                    )
            if problem is None and not (np.array_equal(given[0], grad) and np.array_equal(given[1], params)):
                problem = "grad or params was changed: return the new parameters in a new array"
            if problem is None and any(np.shares_memory(got, a) for a in given):
                problem = "the result shares memory with an argument: return a new array"
            if problem is None:
                got_bytes, ring = _sent(traffic), _sent(halves) + _sent(gathered)
                if got_bytes > ring * BYTES_SLACK + 64:
                    problem = (
                        f"the ranks sent {got_bytes} bytes in all, one reduce-scatter and one allgather send "
                        f"{ring}: reduce-scatter the gradient (an allreduce sends the whole sum to every rank, "
                        "which then needs no allgather at all), update your shard, allgather the parameters"
                    )
            fail_together(sub, problem and f"{context}: {problem}", "zero2_step")
        return None

    each_size(comm, body, "zero2_step")
    passed(
        comm,
        "zero2_step: each rank updates only its shard, with its own momentum, in one reduce-scatter and one allgather",
    )


def _reference_shard(flat: np.ndarray, size: int, rank: int) -> np.ndarray:
    shard = max(1, -(-flat.size // size))
    padded = np.zeros(shard * size, dtype=flat.dtype)
    padded[: flat.size] = flat
    return padded[rank * shard : (rank + 1) * shard].copy()


def check_reshard(fn: Callable[[list[np.ndarray], int, int, int], np.ndarray]) -> None:
    """fn(shards, numel, size, rank) -> rank's shard when `numel` items are cut for `size` ranks.

    `shards` are the equal padded shards another rank count wrote (their padding is not
    zero here: it is nothing the new shard may copy). Each call must return a new array.
    """
    problems = []
    for numel in (10, 12, 2, 7, 1):
        flat = np.random.default_rng(numel).standard_normal(numel)
        shards = [_reference_shard(flat, 4, q) for q in range(4)]
        for size in (2, 3, 1, 4, 5):  # 4 -> 2 -> 3 -> 1 ..., each from the previous count's shards
            old_shard = shards[0].size
            for q, shard in enumerate(shards):  # mark the old padding: it must not reach the new shards
                shard[max(0, numel - q * old_shard) :] = 7e7
            new = []
            for rank in range(size):
                context = f"reshard of {numel} items from {len(shards)} to {size} ranks, rank {rank}"
                given = [s.copy() for s in shards]
                got = fn(given, numel, size, rank)
                problem = array_problem(got, _reference_shard(flat, size, rank), "the new shard")
                if problem is None and any(np.shares_memory(got, s) for s in given):
                    problem = "the new shard shares memory with an old one: return a new array"
                if problem is None and any(not np.array_equal(a, b) for a, b in zip(given, shards)):
                    problem = "the old shards were changed: read them, do not write them"
                if problem:
                    problems.append(f"{context}: {problem}")
                    break
                new.append(got)
            if problems:
                break
            shards = new
        if problems:
            break
    if problems:
        raise CheckFailed(
            problems[0] + "\n(new rank r holds items [r s, (r+1) s) of the flat buffer, "
            "s = ceil(numel / size); copy the overlapping pieces of the old shards, items past "
            "numel are zeros)"
        )
    # every rank ran the same cases, so all fail or pass alike; one line says so, from rank 0
    passed(
        MPI.COMM_WORLD,
        "reshard cuts a checkpoint's shards for any rank count, 4 -> 2 -> 3 -> 1 -> 4 -> 5, padding zeros",
    )


def _zero3_model() -> nn.Sequential:
    generator = torch.Generator().manual_seed(13)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
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


def check_zero3_unit(
    fn: Callable[[nn.Module, Callable[[], None], Callable[[], None], Callable[[], None]], Any],
) -> None:
    """fn(unit, gather, free, reduce) installs hooks on `unit` (an nn.Module) so that, in every step,
    gather() runs before the unit's forward, free() right after it, gather() again before the
    unit's backward, and, once all of the unit's gradients exist, reduce() then free().

    The check wraps three Linear layers of a small model as units (its gather and free fill and
    empty the parameters' storage, its reduce records and clears the gradients), runs two steps
    of forward and backward, and compares the gradients reduce() saw with autograd's on a plain copy.
    """
    reference = _zero3_model()
    x = torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(3, 5)
    reference(x).square().sum().backward()
    problems: list[str] = []
    model = _zero3_model()
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
    for step in range(2):
        for unit in units:
            unit.reduced = 0
        try:
            model(x).square().sum().backward()
        except RuntimeError as err:
            problems.append(
                f"backward failed ({err}): gather() the unit again before its backward needs its "
                "parameters, e.g. in a hook on its output's gradient"
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
            else:
                want = [
                    p.grad if p.grad is not None else torch.zeros_like(p)
                    for p in reference[2 * unit.index].parameters()
                ]
                if not all(torch.allclose(g, w, rtol=1e-12, atol=0) for g, w in zip(unit.grads, want)):
                    problems.append(f"unit {unit.index}: the gradients reduce() saw differ from autograd's")
        if problems:
            break
    if problems:
        raise CheckFailed(problems[0])
    passed(
        MPI.COMM_WORLD,
        "zero3 hooks gather each unit before forward and backward, free it after, and reduce its "
        "gradients once they are complete",
    )
