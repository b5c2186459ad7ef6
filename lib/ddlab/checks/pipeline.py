"""Checks for lab 07: the GPipe and 1F1B schedules, the executor that runs them, and the PipeDream partition.

The schedules are compared op by op with the reference for every stage of 1 to 6
stages and 1 to 9 micro-batches, then run on a simulated pipeline, which catches
orders that deadlock. The executor runs on real ranks through the counting
communicator and must give one process's gradients. The partition is compared with the best split found by
trying them all, on stage-time functions with and without message costs.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from collections import Counter
from typing import Any, Callable

import torch
from mpi4py import MPI
from torch import nn

from ..pipeline import gpipe, in_flight, micro_batch_loss, one_f_one_b, simulate
from ._core import CheckFailed, count, each_size, fail_together, is_integer, is_number, passed, run_counted
from ._draw import Draw, grading_draw, named

HINTS = {
    "gpipe": "GPipe runs the forwards of micro-batches 0..M-1, then their backwards in the same order.",
    "one_f_one_b": (
        "1F1B: warm-up forwards, then one forward and one backward in turn (micro-batches in "
        "order), then the backwards still missing; compare the number of warm-up forwards with "
        "the lab's examples for this stage."
    ),
}


def _show(ops: Any, limit: int = 12) -> str:
    """'F0 F1 B0 ...' for a list of ops."""
    if not isinstance(ops, list):
        return repr(ops)
    parts = [f"{op[0]}{op[1]}" if isinstance(op, tuple) and len(op) == 2 else repr(op) for op in ops[:limit]]
    return " ".join(parts) + (" ..." if len(ops) > limit else "")


def _check_schedule(fn: Callable[[int, int, int], list], reference: Callable[[int, int, int], list]) -> None:
    name = reference.__name__
    draw = grading_draw(None, name)
    for k, m in _schedule_cases(draw):
        got_all = []
        for stage in range(k):
            got = fn(k, m, stage)
            want = reference(k, m, stage)
            got_list = [tuple(op) for op in got] if isinstance(got, (list, tuple)) else got
            if got_list != want:
                first = (
                    next((i for i, (a, b) in enumerate(zip(got_list, want)) if a != b), min(len(got_list), len(want)))
                    if isinstance(got_list, list)
                    else 0
                )
                raise CheckFailed(
                    f"{name}(k={k}, m={m}, stage={stage}) returned {_show(got_list)}\n"
                    f"expected                             {_show(want)}\n"
                    f"(first difference at position {first}){named(draw)}. {HINTS[name]}"
                )
            got_all.append(got_list)
        simulate(got_all)  # a deadlock here would be a bug in the reference
    print(
        f"passed: {name} gives every stage the reference order of forwards and backwards "
        f"(at most {in_flight(reference(4, 8, 0))} micro-batches in flight on stage 0 of 4 with M=8){named(draw)}"
    )


def _schedule_cases(draw: Draw | None) -> list[tuple[int, int]]:
    """(k, m): every k from 1 to 6 with every m from 1 to 9, or the grader's: 1 and 1, and 20 drawn up to 16 and 48."""
    if draw is None:
        return [(k, m) for k in range(1, 7) for m in range(1, 10)]
    return [(1, 1), *((draw.integer(1, 16, "k", i), draw.integer(1, 48, "m", i)) for i in range(20))]


def check_gpipe(fn: Callable[[int, int, int], list]) -> None:
    """fn(k, m, stage) must list GPipe's ops for that stage: [("F", 0), ..., ("B", m-1)]."""
    _check_schedule(fn, gpipe)


def check_one_f_one_b(fn: Callable[[int, int, int], list]) -> None:
    """fn(k, m, stage) must list 1F1B's ops for that stage (warm-up, steady state, cool-down)."""
    _check_schedule(fn, one_f_one_b)


def _brute_force(n: int, k: int, stage_time: Callable[[int, int], float]) -> tuple[float, list[int]]:
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        worst = max(stage_time(a, b) for a, b in zip(bounds, bounds[1:]))
        if best is None or worst < best[0]:
            best = (worst, bounds)
    assert best is not None, "k must be between 1 and n"
    return best


def _cases(draw: Draw | None = None) -> list[tuple[int, int, Callable[[int, int], float], str]]:
    """30 random cases of up to 9 layers (the grader's draw: its own, of up to 12)."""
    rng = random.Random(7 if draw is None else draw.data_seed("layers"))
    cases: list[tuple[int, int, Callable[[int, int], float], str]] = []
    for trial in range(30):
        n = rng.randint(1, 9 if draw is None else 12)
        k = rng.randint(1, n)
        compute = [round(rng.uniform(0.1, 5.0), 2) for _ in range(n)]
        cut = [0.0] * (n + 1)
        label = f"compute={compute}"
        if trial % 2:
            cut[1:-1] = [round(rng.uniform(0, 3.0), 2) for _ in range(n - 1)]
            label += f", plus a message cost {cut[1:-1]} at each cut"

        def stage_time(a: int, b: int, compute: list[float] = compute, cut: list[float] = cut) -> float:
            return sum(compute[a:b]) + cut[a] + cut[b]

        cases.append((n, k, stage_time, label))
    return cases


def check_pipedream_partition(fn: Callable[[int, int, Callable[[int, int], float]], Any]) -> None:
    """fn(n, k, stage_time) must return bounds of k contiguous stages minimising the largest stage_time."""
    draw = grading_draw(None, "pipedream_partition")
    for n, k, stage_time, label in _cases(draw):
        got = fn(n, k, stage_time)
        best, want = _brute_force(n, k, stage_time)
        case = f"n={n}, k={k}, {label}{named(draw)}"
        if not isinstance(got, (list, tuple)) or not all(is_integer(b) for b in got):
            raise CheckFailed(f"{case}: got {got!r}; return a list of k+1 ints (the stage bounds)")
        got = list(got)
        if len(got) != k + 1 or got[0] != 0 or got[-1] != n or any(a >= b for a, b in zip(got, got[1:])):
            raise CheckFailed(
                f"{case}: bounds {got} are not {k} contiguous non-empty stages of {n} layers "
                f"(k+1 increasing ints from 0 to {n}, e.g. {[*range(k), n]})"
            )
        times = [round(stage_time(a, b), 3) for a, b in zip(got, got[1:])]
        if max(times) > best + 1e-9:
            raise CheckFailed(
                f"{case}: bounds {got} give stage times {times}, the slowest {max(times):g}; "
                f"bounds {want} make the slowest {best:g}. Every split of the first j layers on s stages "
                f"must be considered (see the hint before the exercise), message costs included."
            )
    print(f"passed: pipedream_partition finds the split with the fastest slowest stage, messages included{named(draw)}")


# Exercise 7.3: the executor ----------------------------------------------------

TIMEOUT = 10.0
WIDTH, ROWS, MICRO = 3, 2, 5  # features per row, rows per micro-batch, micro-batches
EXECUTOR_HINTS = {
    "error": (
        "A blocking send waits for its receiver, and under 1F1B two "
        "neighbours can be sending to each other at the same moment. Post sends without waiting for them "
        "(Isend, or lab 06's Mailbox.post), wait for them all at the end (Waitall, or Mailbox.free), and "
        "receive each message with its micro-batch's tag."
    ),
    "messages": (
        "Per micro-batch, stage s sends its output to rank s+1 after computing it and the gradient of its "
        "input to rank s-1 after its backward: one message each way, none from the first stage "
        "backward or the last stage forward."
    ),
    "values": (
        "A micro-batch's backward must start from the output its own forward made (keep what backward "
        "needs per micro-batch, receive the gradient tagged with that micro-batch), and gradients must "
        "add up over the micro-batches (do not reset or overwrite .grad between them)."
    ),
    "losses": (
        "The last rank returns one float per micro-batch in micro-batch order (0, 1, ..., M-1), whatever "
        "order its backwards ran in; the other ranks return []."
    ),
}


def mixed_order(k: int, m: int, stage: int) -> list[tuple[str, int]]:
    """All forwards, then the backwards newest first on even stages and oldest first on odd ones.

    A valid schedule in which a stage receives gradients in another order than its
    neighbour sends them: only messages matched by micro-batch give the right gradients.
    """
    ops = gpipe(k, m, stage)
    return ops[:m] + (ops[m:][::-1] if stage % 2 == 0 else ops[m:])


def _chain(k: int, seed: int = 7) -> tuple[list[nn.Module], list[torch.Tensor], list[torch.Tensor]]:
    """k float64 stages (linear, tanh, linear) and MICRO micro-batches of inputs and targets."""
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():  # the same layers on every rank, the caller's random state untouched
        torch.manual_seed(seed)
        stages: list[nn.Module] = [
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)).double() for _ in range(k)
        ]
    inputs = [torch.randn(ROWS, WIDTH, dtype=torch.float64, generator=generator) for _ in range(MICRO)]
    targets = [torch.randn(ROWS, WIDTH, dtype=torch.float64, generator=generator) for _ in range(MICRO)]
    return stages, inputs, targets


def _one_process(
    stages: list[nn.Module], inputs: list[torch.Tensor], targets: list[torch.Tensor]
) -> tuple[list[list[torch.Tensor]], list[float]]:
    """Every stage's parameter gradients for the whole batch in one process, and each micro-batch's loss."""
    chain = copy.deepcopy(nn.Sequential(*stages))
    out = chain(torch.cat(inputs))
    micro_batch_loss(out, torch.cat(targets)).backward()
    losses = [micro_batch_loss(y, t).item() for y, t in zip(out.detach().chunk(MICRO), targets)]
    return [[p.grad for p in stage.parameters() if p.grad is not None] for stage in chain], losses


def _messages_problem(traffic: list[Any], rank: int, k: int) -> str | None:
    sent = Counter(e.peer for e in traffic[rank].sends)
    want = Counter({peer: MICRO for peer in (rank - 1, rank + 1) if 0 <= peer < k})
    if sent != want:

        def show(counts: Counter) -> str:
            return ", ".join(f"{n} to rank {peer}" for peer, n in sorted(counts.items())) or "none"

        return f"sent {show(sent)}; expected {show(want)} ({MICRO} micro-batches)"
    return None


def _values_problem(layers: nn.Module, want: list[torch.Tensor]) -> str | None:
    for index, (param, expected) in enumerate(zip(layers.parameters(), want)):
        if param.grad is None:
            return f"parameter {index} of the stage has no gradient"
        if param.grad.dtype != expected.dtype or not torch.allclose(param.grad, expected, rtol=1e-9, atol=1e-12):
            worst = float((param.grad.double() - expected).abs().max())
            return f"parameter {index}'s gradient differs from one process's by up to {worst:.2e}"
    return None


def _losses_problem(losses: Any, want_losses: list[float]) -> str | None:
    if not isinstance(losses, (list, tuple)) or len(losses) != MICRO or not all(is_number(x) for x in losses):
        return f"returned {losses!r}; the last rank returns the {MICRO} micro-batch losses as numbers"
    if not all(math.isclose(got, expected, rel_tol=1e-9) for got, expected in zip(losses, want_losses)):
        return f"losses {[round(float(x), 6) for x in losses]}, expected {[round(x, 6) for x in want_losses]}"
    return None


def check_run_schedule(fn: Callable[..., Any]) -> None:
    """fn(comm, layers, ops, inputs, targets) runs this rank's stage through ops; same gradients as one process.

    On the first P ranks for every P, under GPipe, 1F1B and a valid mixed order:
    each stage's parameter gradients and the last stage's losses must equal one
    process's (float64), and each rank must send one message per micro-batch to each
    neighbour (forward to rank+1, backward to rank-1), without deadlocking.
    """

    draw = grading_draw(MPI.COMM_WORLD, "run_schedule")  # the grader's: ranks, layers and data
    seed = 7 if draw is None else draw.data_seed("chain") % 10**6

    def body(sub: MPI.Comm) -> str | None:
        k, rank = sub.Get_size(), sub.Get_rank()
        stages, inputs, targets = _chain(k, seed)
        want, want_losses = _one_process(stages, inputs, targets)
        for schedule in (gpipe, one_f_one_b, mixed_order):
            layers = copy.deepcopy(stages[rank])
            args = (layers, schedule(k, MICRO, rank), [x.clone() for x in inputs], [t.clone() for t in targets])
            context = f"run_schedule under {schedule.__name__} on {count(k, 'rank')}{named(draw)}"
            try:
                losses, traffic = run_counted(sub, fn, args, context, timeout=TIMEOUT)
            except CheckFailed as err:  # the deadlock advice only where a rank waited in vain
                stalled = any(word in str(err) for word in ("Stalled", "never waited"))
                raise CheckFailed(f"{err}\n{EXECUTOR_HINTS['error']}" if stalled else str(err)) from None
            problem = _messages_problem(traffic, rank, k)
            fail_together(sub, problem, f"{context}: wrong messages", EXECUTOR_HINTS["messages"])
            if any(not torch.equal(x, y) for x, y in zip(args[2], inputs)):
                problem = "inputs[i] was changed in place; leave the inputs as they are"
            problem = problem or _values_problem(layers, want[rank])
            fail_together(sub, problem, f"{context}: wrong values", EXECUTOR_HINTS["values"])
            if rank < k - 1:
                empty = isinstance(losses, (list, tuple)) and len(losses) == 0
                problem = None if empty else f"returned {losses!r}; the ranks before the last return []"
            else:
                problem = _losses_problem(losses, want_losses)
            fail_together(sub, problem, f"{context}: wrong losses", EXECUTOR_HINTS["losses"])
        return None

    each_size(MPI.COMM_WORLD, body, "run_schedule", draw=draw)
    passed(
        MPI.COMM_WORLD,
        f"run_schedule gives one process's gradients under GPipe, 1F1B and a mixed order on 1 to "
        f"{MPI.COMM_WORLD.Get_size()} stages, one message per micro-batch and direction{named(draw)}",
    )
