"""Checks for lab 06: send and receive as autograd functions, and the balanced split.

The autograd checks train one step of a tiny float64 UNet split over the first P
ranks (P = 2 .. world size), with skip connections crossing ranks, using the
student's function on one side of every message and the reference on the other.
Each rank's parameter gradients must equal one process's, and each rank must send
exactly one message per tensor it owes (activations forward, gradients backward)
with the right number of bytes.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, Callable

import torch
from mpi4py import MPI

from ..data.images import make_segmentation
from ..model_parallel import RecvTensor, SendTensor, Stage, attempt, balanced_split, stage_costs, train_step
from ..model_parallel.stage import gradient_error, reference_gradients
from ..models.unet import UNet
from ..runtime.counting import CountingComm, gather_traffic
from ._core import CheckFailed, each_size, is_integer, passed
from ._draw import Draw, grading_draw, named

TIMEOUT = 15.0
SIDE, BATCH = 8, 2
#: Splits of the 15-layer toy UNet that send skip connections across ranks (to neighbours and beyond).
TOY_SPLITS = {2: [0, 8, 15], 3: [0, 5, 10, 15], 4: [0, 4, 8, 12, 15], 5: [0, 3, 6, 9, 12, 15]}

HINTS = {
    "send": (
        "SendTensor's forward must post x to `peer` and return a 0-dim placeholder; its backward must "
        "receive x's gradient from `peer` (the forward's tag, x's shape and dtype) and return one value "
        "per input of forward: a gradient for x, None for the others."
    ),
    "recv": (
        "RecvTensor's backward must send the gradient it is given to `peer` with the forward message's "
        "tag, once, and return one value per input of forward."
    ),
}
#: What to look at, per exercise, when the activations (forward) or the gradients (backward) went wrong.
PARTS = {
    ("send", "forward"): "SendTensor.forward posts each activation once, to `peer`, with its tag",
    ("send", "backward"): "SendTensor.backward receives x's gradient once (the forward's peer and tag)",
    ("send", "gradients"): "SendTensor.backward returns the gradient it received, unchanged, as x's gradient "
    "(its first value), and None for the mailbox, peer and tag",
    ("recv", "forward"): "RecvTensor.forward takes exactly one message, from `peer` with `tag`",
    ("recv", "backward"): "RecvTensor.backward posts the gradient it is given once, to `peer`, with the forward's "
    "tag, in the dtype it came in",
    ("recv", "gradients"): "RecvTensor.backward sends the gradient it is given, unchanged",
}


def _toy(seed: int = 0) -> tuple[UNet, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = UNet(in_channels=3, classes=3, width=2, depth=2).double()
    images, masks = make_segmentation(BATCH, SIDE, seed=seed + 1, dtype=torch.float64)
    return model, images, masks


def _split(size: int, draw: Draw | None) -> list[int]:
    """The bounds of the toy UNet's 15 layers over `size` ranks: the notebook's, or drawn (any non-empty stages)."""
    if draw is None:
        return TOY_SPLITS[size]
    return [0, *draw.lengths(size - 1, 1, 14, "split", size), 15]


def _expected_sends(stage: Stage) -> Counter:
    """(peer, bytes) of every message this stage owes: its outputs forward, its inputs' gradients backward."""
    size = torch.empty((), dtype=torch.float64).element_size() * BATCH
    owed: Counter[tuple[int, int]] = Counter()
    for edge in stage.outputs:
        owed[(edge.dst, size * torch.Size(edge.shape).numel())] += 1
    for edge in stage.inputs:
        owed[(edge.src, size * torch.Size(edge.shape).numel())] += 1
    return owed


def _describe(sends: Counter) -> str:
    return ", ".join(f"{n} x {nbytes} B to rank {peer}" for (peer, nbytes), n in sorted(sends.items())) or "nothing"


def _one_split(comm: MPI.Comm, which: str, fn: type, draw: Draw | None = None) -> str | None:
    """Train one step over comm's ranks with fn on the `which` side; this rank's problem, or None."""
    model, images, masks = _toy(0 if draw is None else draw.data_seed("model") % 10**6)
    bounds = _split(comm.Get_size(), draw)
    counting = CountingComm(comm, timeout=TIMEOUT)
    functions: dict[str, Any] = {"send_function": SendTensor, "recv_function": RecvTensor, f"{which}_function": fn}
    stage = Stage(model, bounds, counting, (3, SIDE, SIDE), timeout=TIMEOUT, **functions)
    _, problems = attempt(stage, lambda: train_step(stage, images, masks))
    if not any(problems):
        stage.mailbox.recover()  # receive what a wrong backward left unreceived
    traffic = gather_traffic(counting)[comm.Get_rank()]
    stage.mailbox.free()
    counting.free()
    stub = next((p for p in problems if p and p.startswith("NotImplementedError")), None)
    if stub:
        raise NotImplementedError(stub.partition(": ")[2])
    where = f"{comm.Get_size()} ranks, split {bounds}{named(draw)}"
    if problems[comm.Get_rank()]:
        return f"({where}) raised {problems[comm.Get_rank()]}\n{HINTS[which]}"
    if any(problems):
        return None  # this rank only stopped because another failed
    sent = Counter((e.peer, e.nbytes) for e in traffic.sends)
    owed = _expected_sends(stage)
    rank = comm.Get_rank()
    for direction, what, later in (("forward", "activations", True), ("backward", "gradients", False)):
        mine, due = (
            Counter({key: n for key, n in counts.items() if (key[0] > rank) == later}) for counts in (sent, owed)
        )
        if mine != due:
            return (
                f"({where}) {what} sent {direction}: {_describe(mine)}; expected {_describe(due)}. "
                f"Check that {PARTS[which, direction]}"
            )
    error = gradient_error(stage, reference_gradients(model, images, masks))
    if error > 1e-10:
        layers = f"layers {bounds[stage.index]}-{bounds[stage.index + 1] - 1}"
        what = "are missing" if error == float("inf") else f"differ from one process's by up to {error:.3g}"
        return (
            f"({where}) the gradients of stage {stage.index}'s parameters ({layers}) {what}. "
            f"Check that {PARTS[which, 'gradients']}"
        )
    return None


def _check_autograd(which: str, fn: type) -> None:
    world = MPI.COMM_WORLD
    if world.Get_size() < 2:
        raise CheckFailed(
            "this check needs at least 2 engines: start the cluster with ddlab.runtime.cluster.start(n=4)"
        )
    sizes = [p for p in sorted(TOY_SPLITS) if p <= world.Get_size()]
    draw = grading_draw(world, f"{which}_tensor")  # the grader's: ranks, the split, the model and images
    each_size(world, lambda sub: _one_split(sub, which, fn, draw), f"{fn.__name__} is wrong", sizes, draw=draw)
    passed(
        world,
        f"{fn.__name__}: the split UNet's gradients equal one process's; one message per tensor, "
        f"activations forward and gradients backward{named(draw)}",
    )


def check_send_tensor(fn: type) -> None:
    """fn: an autograd Function like ddlab.model_parallel.SendTensor, tested with the reference RecvTensor."""
    _check_autograd("send", fn)


def check_recv_tensor(fn: type) -> None:
    """fn: an autograd Function like ddlab.model_parallel.RecvTensor, tested with the reference SendTensor."""
    _check_autograd("recv", fn)


def _split_cases(draw: Draw | None = None) -> list[tuple[list[float], int]]:
    """Hand-made cases and 40 random ones (the grader's draw: its own 40, of up to 30 layers)."""
    rng = random.Random(6 if draw is None else draw.data_seed("costs"))
    cases = [
        ([5.0], 1),
        ([1.0, 1.0, 1.0, 1.0], 2),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 2),
        ([9.0, 1.0, 1.0, 1.0], 2),
        ([1.0, 1.0, 1.0, 9.0], 3),
        ([0.0, 0.0, 3.0, 0.0], 2),
        ([2.0, 2.0, 2.0], 3),
        ([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0], 4),
    ]
    for _ in range(40):
        n = rng.randint(1, 14 if draw is None else 30)
        costs = [
            round(rng.choice([rng.uniform(0, 1), rng.uniform(0, 10), float(rng.randint(0, 3))]), 3) for _ in range(n)
        ]
        cases.append((costs, rng.randint(1, n)))
    return cases


def check_balanced_split(fn: Callable[[list[float], int], Any]) -> None:
    """fn(costs, k) must return bounds of k contiguous non-empty stages with the smallest largest cost."""
    draw = grading_draw(None, "balanced_split")
    for costs, k in _split_cases(draw):
        n = len(costs)
        got = fn(list(costs), k)
        want = balanced_split(costs, k)
        case = f"costs={costs}, k={k}{named(draw)}"
        if not isinstance(got, (list, tuple)) or not all(is_integer(b) for b in got):
            raise CheckFailed(f"{case}: got {got!r}; return a list of k+1 ints (the stage bounds)")
        got = list(got)
        if len(got) != k + 1 or got[0] != 0 or got[-1] != n or any(a >= b for a, b in zip(got, got[1:])):
            raise CheckFailed(
                f"{case}: bounds {got} are not {k} contiguous non-empty stages of {n} layers: "
                f"they must be k+1 = {k + 1} strictly increasing ints from 0 to {n}"
            )
        mine, best = max(stage_costs(costs, got)), max(stage_costs(costs, want))
        if mine > best + 1e-9 * max(1.0, best):
            raise CheckFailed(
                f"{case}: your bounds {got} give stage costs {stage_costs(costs, got)}, the largest {mine:g}; "
                f"another split would get the largest down to {best:g}"
            )
    print(f"passed: balanced_split finds contiguous stages with the smallest possible largest cost{named(draw)}")
