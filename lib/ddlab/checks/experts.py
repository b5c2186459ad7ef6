"""Checks for lab 15 (experts): the router, and the MoE dispatch (counts by Alltoall, rows by Alltoallv) and combine.

Both run on the whole world first (an answer on the notebook's communicator is seen there), then on
sub-communicators of 1 .. P-1 ranks; all ranks agree on each case's verdict before the next case.
Both hand the student's function a CountingComm that allows exactly the collectives the
lab names, on sub-communicators of every size, and compare with what one process
computes from every rank's rows (each rank can make every rank's rows from its seed):

- `check_dispatch`: the rows received (grouped by source, then by local expert, then
  in the sender's order) and the (P, E/P) int64 counts; exactly one Alltoall of the
  counts (E/P int64 to every rank) and then one Alltoallv of exactly the rows each
  rank's experts take; x left as it was.
- `check_route`: one process (every rank runs it): the kept assignments (token, expert, weight)
  in the order served, the capacity, dropped, load, the balancing loss, and the gradients of the
  weights and of the loss by the logits, against `ddlab.experts.route`, k = 1 and 2, float64 and float32.
- `check_combine`: out[i] is the result for this rank's row i (the inverse
  permutation), carried by one Alltoallv of exactly the rows each rank gets back.

Under the grader's seed (ddlab.checks._draw) each check draws its cases instead of the notebook's:
dispatch and combine the ranks of every sub-communicator (any P of the world's, in any order), the
rows' dtypes (two of the notebook's and one it never shows: the lab allows any), trailing shapes, experts
per rank, rows per rank (a rank with none among them), the skew of the experts chosen and the data; the
router its tokens, experts, k (1 or 2), capacity factor, dtype and logits. Every failure names the case
and the seed.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

from ..experts.router import Routing, route
from ..runtime.counting import COLLECTIVE_TAG, Traffic
from ._core import (
    array_problem,
    count,
    deadline,
    each_size,
    fail_together,
    fail_together_once,
    is_integer,
    passed,
    run_counted,
)
from ._draw import Draw, grading_draw, named
from .errors import CheckFailed

#: (dtype, shape of one row after the first axis, experts per rank or None for 12 in all, skew, last rank empty):
#: rank r holds 5 + 3 r rows (the last rank none, if so marked), routed with a skew towards the first experts.
#: A drawn case (the grader's) has a sixth item, its data seed: rank r then holds 0 to 12 rows, drawn from it.
CASES = (("float64", (3,), None, 1.0, False), ("float32", (2, 2), 1, 0.0, False), ("int64", (), None, 2.0, True))
#: The dtypes the grader draws rows of (the lab: any dtype): two of the notebook's and one of the others.
DRAWN_DTYPES = ("float64", "float32", "int64", "int32", "int16")


def drawn_cases(draw: Draw | None) -> tuple[tuple, ...]:
    """CASES, or the grader's three: dtypes as DRAWN_DTYPES says (in a drawn order), up to 2 trailing axes of up
    to 3, 1 to 3 experts per rank, a skew of 0 to 3, the last rank without rows in one case, a data seed each."""
    if draw is None:
        return CASES
    shown = [d for d in DRAWN_DTYPES if any(case[0] == d for case in CASES)]
    dtypes = draw.choose(shown, 2, "dtypes") + draw.choose([d for d in DRAWN_DTYPES if d not in shown], 1, "new")
    order = draw.rng("order").permutation(3)
    empty = draw.integer(0, 2, "empty")
    cases = []
    for index in range(3):
        trailing = tuple(
            draw.integer(1, 3, "trailing", index, axis) for axis in range(draw.integer(0, 2, "axes", index))
        )
        cases.append(
            (
                dtypes[int(order[index])],
                trailing,
                draw.integer(1, 3, "per rank", index),
                draw.integer(0, 30, "skew", index) / 10,
                index == empty,
                draw.data_seed("rows", index),
            )
        )
    return tuple(cases)


def _experts(case: tuple, size: int) -> int:
    per_rank = case[2]
    return 12 if per_rank is None else per_rank * size


def _label(case: tuple, rows: int, experts: int, draw: Draw | None) -> str:
    """A case's words in a message: its rows, shape and experts (and, drawn, its skew, data seed and the seed)."""
    label = f"{count(rows, np.dtype(case[0]).name + ' row')} of shape {case[1]}, {count(experts, 'expert')}"
    return label if draw is None else f"{label}, skew {case[3]}, data seed {case[5]}{named(draw)}"


def _rows(case: tuple, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank's rows and their experts: row i of rank r reads 1000 r + i (+ an eighth per feature), so a mix-up shows."""
    dtype, shape, _, skew, last_empty = case[:5]
    seed = case[5] if len(case) > 5 else None
    n = 5 + 3 * rank if seed is None else int(np.random.default_rng([seed, rank, size]).integers(0, 13))
    if last_empty and rank == size - 1 and size > 1:
        n = 0
    experts = _experts(case, size)
    weights = np.exp(-skew * np.arange(experts) / experts)
    rng = np.random.default_rng([rank, size, experts] if seed is None else [seed, rank, size, experts])
    expert = rng.choice(experts, n, p=weights / weights.sum()).astype(np.int64)
    base = (1000 * rank + np.arange(n)).reshape((n,) + (1,) * len(shape))
    features = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape) / 8 if shape else 0
    return (base + features).astype(dtype), expert


def _received(case: tuple, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """What rank receives in a dispatch, and its counts, computed in one process from every rank's rows."""
    experts = _experts(case, size)
    local = experts // size
    mine = range(rank * local, (rank + 1) * local)
    rows, counts = [], np.zeros((size, local), dtype=np.int64)
    for s in range(size):
        x, expert = _rows(case, s, size)
        for j, e in enumerate(mine):
            rows.append(x[expert == e])
            counts[s, j] = np.count_nonzero(expert == e)
    return np.concatenate(rows), counts


def _sent_bytes(case: tuple, rank: int, size: int) -> list[int]:
    """Bytes of the rows this rank sends each rank in a dispatch (and receives back from it in combine)."""
    x, expert = _rows(case, rank, size)
    per_rank = np.bincount(expert, minlength=_experts(case, size)).reshape(size, -1).sum(1)
    return [int(c) * x.itemsize * int(np.prod(x.shape[1:], dtype=np.int64)) for c in per_rank]


def _calls_problem(traffic: Traffic, calls: list[str], want_bytes: dict[str, list[int]]) -> str | None:
    """The collectives called, in order, no point-to-point message, and the bytes each sends to every rank."""
    if traffic.calls != calls:
        if sorted(traffic.calls) == sorted(calls):
            return (
                f"called {' then '.join(traffic.calls)}: exchange the counts first (Alltoall), so that every "
                "rank knows how much it receives before the rows travel"
            )
        got = ", ".join(traffic.calls) or "no collective"
        return f"called {got}; expected exactly {' then '.join(calls)}"
    if any(e.tag != COLLECTIVE_TAG for e in traffic.events):
        return "sent or received point-to-point messages: the collectives named carry everything"
    sends = [e.nbytes for e in traffic.sends]
    start = 0
    for name in calls:
        want = want_bytes[name]
        sent = sends[start : start + len(want)]
        if sent != want:
            d = next(d for d, (a, b) in enumerate(zip(sent, want)) if a != b)
            return f"its {name} sends rank {d} {sent[d]} bytes, expected {want[d]} (counts and displacements are in elements)"
        start += len(want)
    return None


def _sizes(world: MPI.Comm) -> list[int]:
    """The world's size first (an answer that calls the notebook's communicator completes there, and is
    seen to), then 1 .. size - 1."""
    size = world.Get_size()
    return [size, *range(1, size)]


def _pair(result: Any, first: str, second: str) -> str | None:
    if not isinstance(result, tuple) or len(result) != 2:
        return f"should return a tuple ({first}, {second}), got {type(result).__name__}"
    return None


def check_dispatch(fn: Callable[..., tuple[np.ndarray, np.ndarray]], timeout: float = 20.0) -> None:
    """fn(comm, x, expert, n_experts) -> (rows, counts): one Alltoall of counts, then one Alltoallv of rows.

    timeout: seconds a rank may wait for a collective the others never call.
    The grader's draw: the ranks of every sub-communicator (any P of the world's, in any order) and the
    cases of drawn_cases (dtypes, trailing shapes, experts per rank, rows per rank, skew, data)."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "dispatch")

    def body(comm: MPI.Comm) -> str | None:
        rank, size = comm.Get_rank(), comm.Get_size()
        for case in drawn_cases(draw):
            experts = _experts(case, size)
            x, expert = _rows(case, rank, size)
            original, original_expert = x.copy(), expert.copy()
            label = _label(case, len(x), experts, draw)
            result, traffic = run_counted(
                comm, fn, (x, expert, experts), f"dispatch with {label}", timeout, allow=("Alltoall", "Alltoallv")
            )
            want_rows, want_counts = _received(case, rank, size)
            problem = _pair(result, "rows", "counts")
            if problem is None:
                rows, counts = result
                problem = array_problem(counts, want_counts, "counts (rows from each rank for each local expert)")
                problem = problem or array_problem(rows, want_rows, "the rows received")
                if problem is None and np.shares_memory(rows, x):
                    problem = "returned x or a view of it: return a new array"
            if problem is None and not (np.array_equal(x, original) and np.array_equal(expert, original_expert)):
                problem = "changed x or expert: leave the caller's arrays as they are"
            if problem is None:
                want = {"Alltoall": [(experts // size) * 8] * size, "Alltoallv": _sent_bytes(case, rank, size)}
                problem = _calls_problem(traffic[rank], ["Alltoall", "Alltoallv"], want)
            # every rank of comm agrees on this case's verdict before the next case's collectives
            fail_together(comm, problem and f"{label}: {problem}", f"dispatch on {count(size, 'rank')}")
        return None

    each_size(world, body, "dispatch", _sizes(world), draw=draw)
    passed(
        world,
        f"dispatch: counts by one Alltoall, then exactly the planned rows by one Alltoallv, in order{named(draw)}",
    )


def check_combine(fn: Callable[..., np.ndarray], timeout: float = 20.0) -> None:
    """fn(comm, y, counts, expert, n_experts) -> out: one Alltoallv back, then out[i] is row i's result.

    timeout: seconds a rank may wait for a collective the others never call.
    The grader's draw: as check_dispatch's (ranks, and the cases of drawn_cases)."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "combine")

    def body(comm: MPI.Comm) -> str | None:
        rank, size = comm.Get_rank(), comm.Get_size()
        for case in drawn_cases(draw):
            experts = _experts(case, size)
            local = experts // size
            x, expert = _rows(case, rank, size)
            rows, counts = _received(case, rank, size)
            # the experts' work: expert e adds 10 (e + 1) to a row, so a result in the wrong place shows
            labels = np.concatenate([np.repeat(rank * local + np.arange(local), row) for row in counts])
            y = (rows + 10 * (labels + 1).reshape((-1,) + (1,) * (rows.ndim - 1))).astype(rows.dtype)
            original = y.copy()
            label = _label(case, len(x), experts, draw)
            out, traffic = run_counted(
                comm,
                fn,
                (y, counts.copy(), expert.copy(), experts),
                f"combine with {label}",
                timeout,
                allow=("Alltoallv",),
            )
            want = (x + 10 * (expert + 1).reshape((-1,) + (1,) * (x.ndim - 1))).astype(x.dtype)
            problem = array_problem(out, want, "out (row i: the result for this rank's row i)")
            if problem is None and np.shares_memory(out, y):
                problem = "returned y or a view of it: return a new array"
            if problem is None and not np.array_equal(y, original):
                problem = "changed y: leave the caller's array as it is"
            if problem is None:
                row = y.itemsize * int(np.prod(y.shape[1:], dtype=np.int64))
                problem = _calls_problem(
                    traffic[rank], ["Alltoallv"], {"Alltoallv": [int(c) * row for c in counts.sum(1)]}
                )
            # every rank of comm agrees on this case's verdict before the next case's collectives
            fail_together(comm, problem and f"{label}: {problem}", f"combine on {count(size, 'rank')}")
        return None

    each_size(world, body, "combine", _sizes(world), draw=draw)
    passed(world, f"combine: one Alltoallv back, every result in its row's place{named(draw)}")


#: Seconds one call of the router may take (32 tokens: a correct one takes milliseconds).
ROUTE_DEADLINE = 10.0

#: (tokens, experts, k, capacity factor, dtype, seed) of check_route's cases: drops and none, k = 1 and 2.
ROUTE_CASES = (
    (32, 8, 1, 1.0, torch.float64, 0),
    (32, 8, 2, 1.0, torch.float64, 1),
    (30, 4, 2, 1.25, torch.float32, 2),
    (12, 6, 1, 2.0, torch.float32, 3),
    (16, 4, 1, 0.5, torch.float64, 4),
)


def _route_problem(got: Any, want: Routing, logits: torch.Tensor, got_logits: torch.Tensor) -> str | None:
    """What differs between the student's routing and the library's, gradients of weight and loss included."""
    if not isinstance(got, Routing):
        return f"return a Routing(token, expert, weight, dropped, capacity, load, aux_loss), got {type(got).__name__}"
    for name in ("capacity", "dropped"):
        if not is_integer(getattr(got, name)) or getattr(got, name) != getattr(want, name):
            return f"{name} is {getattr(got, name)!r}, expected {getattr(want, name)}"
    for name in ("token", "expert", "load"):
        value = getattr(got, name)
        if not isinstance(value, torch.Tensor):
            return f"{name} should be a tensor, got {type(value).__name__}"
        problem = array_problem(value.detach().numpy(), getattr(want, name).numpy(), name)
        if problem:
            order = " (first choices of every token in token order, then second choices)" if name != "load" else ""
            return problem + order
    for name in ("weight", "aux_loss"):
        value = getattr(got, name)
        if not isinstance(value, torch.Tensor):
            return f"{name} should be a tensor, got {type(value).__name__}"
        problem = array_problem(value.detach().numpy(), getattr(want, name).detach().numpy(), name, rtol=1e-5)
        if problem:
            return problem
    # the gradients: weights carry the gate's, and the balancing loss pushes on P_i only
    for name in ("weight", "aux_loss"):
        value = getattr(got, name)
        if not value.requires_grad:
            return f"{name} carries no gradient to the logits: compute it from the softmax, do not detach it"
        seed = torch.Generator().manual_seed(len(name))
        direction = torch.randn(value.shape, generator=seed, dtype=value.dtype)
        (grad_got,) = torch.autograd.grad((value * direction).sum(), got_logits, retain_graph=True)
        (grad_want,) = torch.autograd.grad((getattr(want, name) * direction).sum(), logits, retain_graph=True)
        scale = float(grad_want.abs().max())  # an exact 0 and a rounding residue of the reference's are alike
        problem = array_problem(
            grad_got.numpy(), grad_want.numpy(), f"the gradient of {name} by the logits", rtol=1e-5, atol=1e-6 * scale
        )
        if problem:
            return problem + (
                " (f_i carries no gradient: only the mean probability P_i does)" if name == "aux_loss" else ""
            )
    return None


def route_cases(draw: Draw | None) -> tuple[tuple[int, int, int, float, torch.dtype, int], ...]:
    """ROUTE_CASES, or the grader's five: 1 to 48 tokens, 2 to 12 experts, k = 1 and 2 (both, in a drawn order,
    then drawn), capacity factors of 0.25 to 3 in quarters, float64 and float32, a logits seed each."""
    if draw is None:
        return ROUTE_CASES
    flip, types = draw.integer(0, 1, "k"), (torch.float64, torch.float32)
    cases = []
    for index in range(5):
        k = 1 + (index + flip) % 2 if index < 2 else draw.integer(1, 2, "k", index)
        experts, dtype = draw.integer(2, 12, "experts", index), types[draw.integer(0, 1, "dtype", index)]
        factor = draw.integer(1, 12, "factor", index) / 4
        cases.append((draw.integer(1, 48, "tokens", index), experts, k, factor, dtype, draw.data_seed("logits", index)))
    return tuple(cases)


def check_route(fn: Callable[..., Routing]) -> None:
    """fn(logits, k, capacity_factor) -> Routing, as `ddlab.experts.route` gives: one process, on every rank.

    The grader's draw: the cases of route_cases (tokens, experts, k, capacity factor, dtype, logits' seed)
    and the expert the logits crowd."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "route")
    problem = None
    for tokens, experts, k, factor, dtype, seed in route_cases(draw):
        label = f"{tokens} tokens, {experts} experts, k = {k}, capacity factor {factor}, {str(dtype)[6:]}"
        crowded = 0 if draw is None else draw.integer(0, experts - 1, "crowded", seed)
        if draw is not None:
            label += f", logits of seed {seed} crowding expert {crowded}{named(draw)}"
        base = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed), dtype=dtype)
        base[:, crowded] += 1.0  # a crowded expert, so capacities bind
        logits, given = base.clone().requires_grad_(), base.clone().requires_grad_()
        want = route(logits, k, factor)
        try:
            with deadline(ROUTE_DEADLINE, f"route({label})"):
                got = fn(given, k, factor)
        except NotImplementedError:
            raise
        except CheckFailed as err:  # past the deadline: this rank's problem, agreed on below
            problem = str(err)
        except Exception as err:  # the student's router failed: say how
            problem = f"raised {type(err).__name__}: {err}"
        else:
            problem = _route_problem(got, want, logits, given)
            if problem is None and not torch.equal(given.detach(), base):
                problem = "changed the logits: leave the caller's tensor alone"
        if problem:
            problem = f"{label}: {problem}"
            break
    fail_together_once(
        world, problem, "route", "(see `ddlab.experts.router`'s docstring for the order tokens are served in)"
    )
    passed(
        world,
        "route: top-k, capacity, the dropped assignments, the load and the balancing loss with its gradient"
        + named(draw),
    )
