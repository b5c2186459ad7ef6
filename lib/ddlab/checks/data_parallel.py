"""Checks for lab 04 (data parallelism): sharding, broadcast, gradient averaging, a training step.

The checks that need several ranks run on all engines at once (%%px) and compare with
what one process computes, in float64, to a relative 1e-10: data parallelism done
right is not approximately the same as one process with the global batch, it is the
same up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from ..allreduce import Allreduce
from ..data.curves import StressStrainCurves
from ..data_parallel import DataParallel, plan_buckets, squared_error, train
from ..models.mlp import make_mlp
from ..runtime.comm import Comm
from ._core import count, each_size, fail_together, is_number, passed, run_counted
from ._draw import Draw, grading_draw, named
from .allreduce import DTYPES, _drawn_dtypes, _inputs, value_problem
from .errors import CheckFailed

TOLERANCE = 1e-10
TIMEOUT = 20.0  # seconds a rank may wait for another inside the student's code


def _call(
    comm: MPI.Comm, call: Callable[[Any], Any], context: str, allow: tuple[str, ...] = (), timeout: float = TIMEOUT
) -> Any:
    """call(counting) on every rank, `counting` a counting communicator standing for comm.

    The MPI collectives named in `allow` run under a timeout and others are refused, so a
    rank left behind fails the check within the timeout instead of hanging it; an error
    on any rank fails every rank. A stub's NotImplementedError passes through.
    """
    return run_counted(comm, call, (), context, timeout, allow=allow)[0]


def _small_and_all(size: int) -> list[int]:
    """3 ranks (not a power of two) and all of them."""
    return sorted({min(3, size), size})


def _relative(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-300))


# Exercise 4.1 ---------------------------------------------------------------------


def _shard_problem(fn: Callable[..., np.ndarray], n: int, size: int, epoch: int, seed: int) -> str | None:
    shards = []
    for rank in range(size):
        got = fn(n, rank, size, epoch, seed)
        if not isinstance(got, np.ndarray) or got.ndim != 1 or (got.size and got.dtype.kind not in "iu"):
            return f"n={n}, size={size}: rank {rank} should get a 1-D NumPy array of integers, got {got!r:.80}"
        shards.append(got)
    want = -(-n // size)
    lengths = [len(s) for s in shards]
    if any(length != want for length in lengths):
        return (
            f"n={n} samples over size={size} ranks: shard lengths {lengths}, expected {want} on every rank. "
            "Every rank must take the same number of steps, or the last allreduce waits forever: "
            "pad by repeating samples from the start of the epoch's order"
        )
    everything = np.concatenate(shards) if shards else np.array([], dtype=np.int64)
    if everything.size and (everything.min() < 0 or everything.max() >= n):
        return f"n={n}, size={size}: indices must lie in [0, {n}), got {everything.min()}..{everything.max()}"
    missing = sorted(set(range(n)) - set(everything.tolist()))
    if missing:
        return (
            f"n={n}, size={size}, epoch={epoch}: no rank gets samples {missing[:5]}{'...' if len(missing) > 5 else ''}"
        )
    repeats = everything.size - n
    if repeats != want * size - n:
        return f"n={n}, size={size}: {repeats} samples appear twice, expected only the {want * size - n} of padding"
    dealt = np.empty(want * size, dtype=everything.dtype)
    for rank, shard in enumerate(shards):
        dealt[rank::size] = shard
    alone = np.resize(np.asarray(fn(n, 0, 1, epoch, seed)), want * size)  # one rank's order, padded from its start
    if not np.array_equal(dealt, alone):
        at = int(np.flatnonzero(dealt != alone)[0])
        return (
            f"n={n}, size={size}, epoch={epoch}: read in turn (rank 0's first index, rank 1's first, ..., then "
            f"every rank's second, ...), the shards should be the order one rank alone gets (size=1), padded "
            f"with its own first entries; position {at} holds {dealt[at]} instead of {alone[at]}. Each rank "
            "takes every size-th entry of the padded order, starting at its rank"
        )
    return None


def check_shard_indices(fn: Callable[[int, int, int, int, int], np.ndarray]) -> None:
    """fn(n, rank, size, epoch, seed): disjoint shards of equal length covering all samples, padded
    with the order's first entries when size does not divide n, each rank taking every size-th entry
    of one order (the one size=1 gives), the same on every call, reshuffled each epoch and seed.

    The grader's draw: the sample counts (up to 500), rank counts (up to 16), epochs and seeds."""
    draw = grading_draw(None, "shard_indices")
    n, size = (64, 4) if draw is None else (draw.integer(32, 500, "n"), draw.integer(2, 16, "size"))
    first = [np.asarray(fn(n, r, size, 0, 0)) for r in range(size)]
    if any(not np.array_equal(a, np.asarray(fn(n, r, size, 0, 0))) for r, a in enumerate(first)):
        raise CheckFailed(
            "two calls with the same (n, rank, size, epoch, seed) gave different shards: "
            "every rank must compute the same order without talking, so draw it from a "
            "generator seeded with (seed, epoch), e.g. np.random.default_rng([seed, epoch])"
        )
    for n_, size_ in _shard_cases(draw):
        for epoch, seed in [(0, 0), (1, 0), (0, 7)] if draw is None else _epochs_and_seeds(draw, n_, size_):
            problem = _shard_problem(fn, n_, size_, epoch, seed)
            if problem:
                raise CheckFailed(problem + named(draw))
    if all(np.array_equal(a, fn(n, r, size, 1, 0)) for r, a in enumerate(first)):
        raise CheckFailed(
            "epoch 0 and epoch 1 give the same shards: reshuffle every epoch (seed the order "
            "with the epoch number), or every epoch sees the same batches"
        )
    if all(np.array_equal(a, fn(n, r, size, 0, 1)) for r, a in enumerate(first)):
        raise CheckFailed("seeds 0 and 1 give the same shards: the order must depend on the seed")
    print(f"passed: shard_indices gives equal, disjoint shards, padded, reshuffled each epoch{named(draw)}")


def _shard_cases(draw: Draw | None) -> list[tuple[int, int]]:
    """(n, size) pairs: the notebook's, or 7 drawn (n up to 500, 0 and 1 among them; size up to 16)."""
    if draw is None:
        return [(12, 4), (10, 4), (13, 3), (1, 3), (100, 7), (64, 1), (0, 2)]
    counts = [0, 1, *draw.lengths(5, 2, 500, "counts")]
    return [(n, draw.integer(1, 16, "size", n)) for n in counts]


def _epochs_and_seeds(draw: Draw, n: int, size: int) -> list[tuple[int, int]]:
    """Three drawn (epoch, seed) pairs for one case."""
    return [(draw.integer(0, 50, "epoch", n, size, i), draw.integer(0, 10**6, "seed", n, size, i)) for i in range(3)]


# Exercise 4.2 ---------------------------------------------------------------------


def _tiny_model(seed: int) -> nn.Module:
    """Linear layers and a BatchNorm (whose running statistics are buffers), different per seed."""
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
            else:
                tensor.fill_(seed)
    return model


def _state(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: t.detach().numpy().copy() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def _broadcast_problem(
    fn: Callable[..., None], comm: MPI.Comm, root: int, timeout: float, seed: int = 100
) -> str | None:
    """What is wrong after fn(model, comm, root) on this rank of `comm`, or None (rank r's model: seed + r)."""
    model = _tiny_model(seed=seed + comm.Get_rank())
    objects = [id(t) for t in [*model.parameters(), *model.buffers()]]
    _call(
        comm,
        lambda counting: fn(model, counting, root),
        f"broadcast_parameters(model, comm, {root})",
        allow=("Bcast",),
        timeout=timeout,
    )
    if objects != [id(t) for t in [*model.parameters(), *model.buffers()]]:
        return (
            "the model's parameters were replaced by new tensors: copy into them in place "
            "(the optimizer holds the old ones), e.g. comm.Bcast(p.detach().numpy(), root)"
        )
    want, got, buffers = _state(_tiny_model(seed=seed + root)), _state(model), dict(model.named_buffers())
    for name in want:
        if not np.array_equal(got[name], want[name]):
            kind = "buffer" if name in buffers else "parameter"
            return (
                f"{kind} {name!r} differs from rank {root}'s (largest difference "
                f"{np.max(np.abs(got[name] - want[name])):.3g})"
                + (": buffers (BatchNorm's running statistics) must be broadcast too" if kind == "buffer" else "")
            )
    return None


def check_broadcast_parameters(fn: Callable[..., None], timeout: float = TIMEOUT) -> None:
    """fn(model, comm, root=0) gives every rank root's parameters and buffers, in place.

    Runs on the first P ranks for every P; ranks outside wait, and every rank of the
    world learns the outcome (a stub's NotImplementedError included), so none is left behind.
    """
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "broadcast_parameters")  # the grader's: ranks, a third root, the models' seeds
    seed = 100 if draw is None else draw.data_seed("models")

    def every_root(sub: MPI.Comm) -> None:
        size = sub.Get_size()
        roots = {0, size - 1} if draw is None else {0, size - 1, draw.integer(0, size - 1, "root", size)}
        for root in sorted(roots):
            fail_together(
                sub,
                _broadcast_problem(fn, sub, root, timeout, seed),
                f"broadcast_parameters on {size} ranks, root {root}{'' if draw is None else f', models of seed {seed}'}",
            )

    each_size(world, every_root, "broadcast_parameters", draw=draw)
    passed(world, f"broadcast_parameters copies the root's parameters and buffers to every rank, in place{named(draw)}")


# Exercise 4.3 ---------------------------------------------------------------------


def _counting(log: list[int]) -> Allreduce:
    """The MPI library's allreduce, noting the length of each call in `log`."""

    def allreduce(comm: Comm, x: np.ndarray) -> np.ndarray:
        log.append(int(np.asarray(x).size))
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=MPI.SUM)
        return out

    return allreduce


def _set_gradients(model: nn.Module, rank: int, seed: int = 1000) -> None:
    """Gradients that differ from rank to rank and are known to every rank."""
    generator = torch.Generator().manual_seed(seed + rank)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)


def _average_problem(comm: MPI.Comm, fn: Callable[..., None], timeout: float, seed: int = 1000) -> str | None:
    """What is wrong on this rank after fn(model, comm, allreduce) on the ranks of comm, or None."""
    rank, size = comm.Get_rank(), comm.Get_size()
    model = make_mlp(seed=3, dtype=torch.float64)
    before = _state(model)
    _set_gradients(model, rank, seed)
    log: list[int] = []
    _call(
        comm,
        lambda counting: fn(model, counting, _counting(log)),
        "average_gradients(model, comm, allreduce)",
        allow=("Allreduce",),
        timeout=timeout,
    )
    references: list[list[torch.Tensor]] = []
    for r in range(size):
        other = make_mlp(seed=3, dtype=torch.float64)
        _set_gradients(other, r, seed)
        references.append([p.grad for p in other.parameters() if p.grad is not None])
    numel = sum(p.numel() for p in model.parameters())
    if not log:
        return (
            "the allreduce passed in was never called: use it (not comm.Allreduce), "
            "so that any allreduce, your ring from lab 03 too, can be plugged in"
        )
    if len(log) > 1:
        return (
            f"{len(log)} allreduce calls of {log[:6]}{'...' if len(log) > 6 else ''} elements: flatten "
            f"all gradients into one array of {numel} and call allreduce once (each call costs one alpha)"
        )
    for i, (name, p) in enumerate(model.named_parameters()):
        grads = torch.stack([reference[i] for reference in references])
        if p.grad is None:
            return f"{name} has no gradient after average_gradients"
        if _relative(p.grad, grads.mean(0)) > TOLERANCE:
            hint = (
                " (that is the sum over ranks: divide by comm.Get_size())"
                if size > 1 and _relative(p.grad, grads.sum(0)) < TOLERANCE
                else " (that is this rank's own gradient: nothing was averaged)"
                if size > 1 and _relative(p.grad, grads[rank]) < TOLERANCE
                else f" (it is, but only to float32 precision: keep the gradients' {p.dtype} through the allreduce)"
                if _relative(p.grad, grads.mean(0)) < 1e-6
                else ""
            )
            return f"the gradient of {name} is not the mean over the {size} ranks{hint}"
        if p.grad.dtype != p.dtype:
            return f"the gradient of {name} is {p.grad.dtype}, the parameter {p.dtype}: keep the gradients' dtype"
    if any(not np.array_equal(v, _state(model)[k]) for k, v in before.items()):
        return "the parameters changed: average_gradients must change only the gradients"
    return None


def check_average_gradients(fn: Callable[..., None], timeout: float = TIMEOUT) -> None:
    """fn(model, comm, allreduce) replaces every gradient by its mean over ranks, with one allreduce;
    on 3 ranks (not a power of two) and on all."""
    world = MPI.COMM_WORLD
    sizes = _small_and_all(world.Get_size())
    draw = grading_draw(world, "average_gradients")  # the grader's: ranks and the gradients' seed
    seed = 1000 if draw is None else draw.data_seed("gradients")
    context = "average_gradients" if draw is None else f"average_gradients, gradients of seed {seed}"
    each_size(world, lambda sub: _average_problem(sub, fn, timeout, seed), context, sizes, draw=draw)
    numel = sum(p.numel() for p in make_mlp().parameters())
    passed(
        world,
        f"average_gradients averages all {numel} gradient entries in one allreduce, "
        f"on {' and '.join(map(str, sizes))} ranks{named(draw)}",
    )


# Exercise 4.4 ---------------------------------------------------------------------
OVERLAP_CAP_MB = 0.1  # the lab MLP's gradients in 3 buckets (in float32; in float64, 4)
STEPS = {2: "two", 3: "three", 4: "four"}


@dataclass(frozen=True)
class Training:
    """What checks 4.4 and 4.5 train: the batch per rank, the steps, SGD's rate, the seeds of the data,
    of the model's start and of the batches' order; 4.5's bucket cap. The defaults are the notebook's."""

    per_rank: int = 8
    steps: int = 3
    lr: float = 0.1
    data_seed: int = 3
    model_seed: int = 5
    order_seed: int = 11
    cap_mb: float = OVERLAP_CAP_MB

    def __str__(self) -> str:
        return (
            f"batch {self.per_rank} per rank, {self.steps} steps, lr {self.lr:g}, data seed {self.data_seed}, "
            f"model seed {self.model_seed}, order seed {self.order_seed}"
        )


def drawn_training(draw: Draw | None) -> Training:
    """The notebook's training, or the grader's: a batch of 1 to 16 per rank, 2 to 4 steps, a rate in
    [0.01, 0.2], seeds for the data, the model and the order, and a bucket cap (`_drawn_cap`)."""
    if draw is None:
        return Training()
    return Training(
        per_rank=draw.integer(1, 16, "per_rank"),
        steps=draw.integer(2, 4, "steps"),
        lr=round(float(draw.rng("lr").uniform(0.01, 0.2)), 3),
        data_seed=draw.data_seed("data"),
        model_seed=draw.data_seed("model"),
        order_seed=draw.data_seed("order"),
        cap_mb=_drawn_cap(draw),
    )


def _drawn_cap(draw: Draw) -> float:
    """A bucket cap in MB, log-uniform from 0.0003 to 1.26: from one bucket per tensor of the lab MLP's
    float64 gradients (1.13 MB in 8 tensors) to a single bucket."""
    return round(10 ** float(draw.rng("cap").uniform(-3.5, 0.1)), 4)


def _drawn_sizes(size: int, draw: Draw | None) -> list[int]:
    """3 ranks and all (the notebook's), and under the grader's draw one more count from 1 to all."""
    return sorted({*_small_and_all(size), *([] if draw is None else [draw.integer(1, size, "ranks")])})


def _global_batches(steps: int, per_rank: int, size: int, seed: int = 11) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(steps * per_rank * size)
    return [order[k * per_rank * size : (k + 1) * per_rank * size] for k in range(steps)]


def _one_process(
    batches: list[np.ndarray], data: StressStrainCurves, lr: float, model_seed: int = 5
) -> list[torch.Tensor]:
    """Parameters after one process takes SGD steps on `batches` (float64)."""
    model = make_mlp(seed=model_seed, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches:
        x, y = data[batch]
        loss = squared_error(model(x), y).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _train_step_problem(
    comm: MPI.Comm, fn: Callable[..., float], timeout: float, case: Training, drawn: str = ""
) -> str | None:
    """What is wrong on this rank after a few fn(model, optimizer, x, y, comm) steps, or None."""
    rank, size = comm.Get_rank(), comm.Get_size()
    per_rank, steps, lr = case.per_rank, case.steps, case.lr
    data = StressStrainCurves(n=steps * per_rank * size, seed=case.data_seed, dtype=torch.float64)
    batches = _global_batches(steps, per_rank, size, case.order_seed)
    model = make_mlp(seed=case.model_seed, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def step_on(x: torch.Tensor, y: torch.Tensor) -> Callable[[Any], Any]:
        return lambda counting: fn(model, optimizer, x, y, counting)

    losses = [
        _call(comm, step_on(*data[batch[rank::size]]), f"train_step (step {step}{drawn})", ("Allreduce",), timeout)
        for step, batch in enumerate(batches)
    ]
    if not all(is_number(loss) for loss in losses):
        kind = next(type(loss).__name__ for loss in losses if not is_number(loss))
        return f"train_step should return the loss as a float (loss.item()), got {kind}"
    got = [p.detach() for p in model.parameters()]
    worst = max(_relative(g, w) for g, w in zip(got, _one_process(batches, data, lr, case.model_seed)))
    if worst <= TOLERANCE:
        return None
    problem = (
        f"after {steps} steps the parameters differ from one process with batch {size}x{per_rank} "
        f"by up to {worst:.2e} (relative; at most {TOLERANCE:g} expected)"
    )
    summed = _one_process(batches, data, lr * size, case.model_seed)
    local = _one_process([b[rank::size] for b in batches], data, lr, case.model_seed)
    if size > 1 and max(_relative(g, w) for g, w in zip(got, summed)) <= TOLERANCE:
        return problem + ": they match the SUM of the gradients; average them (divide by the number of ranks)"
    if size > 1 and max(_relative(g, w) for g, w in zip(got, local)) <= TOLERANCE:
        return problem + ": they match training on this rank's batch alone; average the gradients before the step"
    return problem + (
        ". The order is: zero the gradients, loss = squared_error(model(x), y).mean(), "
        "backward, average the gradients over ranks, optimizer step"
    )


def check_train_step(fn: Callable[..., float], timeout: float = TIMEOUT) -> None:
    """fn(model, optimizer, x, y, comm) on P ranks with batch b = one process with batch P*b;
    on 3 ranks (not a power of two) and on all.

    The grader's draw: the ranks (any of them, in any order) and one more rank count, the batch per
    rank (1 to 16), the steps (2 to 4), SGD's rate and the seeds of the data, the model and the order."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "train_step")
    case = drawn_training(draw)
    sizes = _drawn_sizes(world.Get_size(), draw)
    drawn = "" if draw is None else f", {case}"
    each_size(
        world, lambda sub: _train_step_problem(sub, fn, timeout, case, drawn), f"train_step{drawn}", sizes, draw=draw
    )
    passed(
        world,
        f"train_step on {' and '.join(map(str, sizes))} ranks x batch {case.per_rank} = one process with the "
        f"global batch (relative difference at most {TOLERANCE:g}){named(draw)}",
    )


# Exercise 4.5 ---------------------------------------------------------------------
NEXT_STEP_HINT = (
    "what the hooks and finish() count per step (gradients ready, the next bucket to start, the "
    "requests) must start again from zero for the next step"
)
HOOK_HINT = (
    "a hook that reads p.grad must run after the gradient is accumulated: "
    "p.register_post_accumulate_grad_hook(hook), whose hook receives the parameter"
)


class _Recorder:
    """A counting communicator that notes each Iallreduce: its length, and whether backward was running."""

    def __init__(self, counting: Any):
        self.counting = counting
        self.in_backward = False
        self.starts: list[tuple[int, bool]] = []

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: MPI.Op = MPI.SUM) -> MPI.Request:
        buffer = recvbuf if sendbuf is MPI.IN_PLACE else sendbuf
        self.starts.append((int(np.asarray(buffer).size), self.in_backward))
        return self.counting.Iallreduce(sendbuf, recvbuf, op)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.counting, name)


def _overlap_problem(
    comm: MPI.Comm, fn: Callable[..., Callable[[], None]], timeout: float, case: Training, drawn: str = ""
) -> str | None:
    """What is wrong on this rank, or None: fn's hooks train a few steps with the buckets as plan_buckets
    makes them (last layer first, so they complete in bucket order), then with the same buckets handed
    first layer first, so that bucket 0 completes last and starting buckets as they complete breaks the order."""
    for reverse in (False, True):
        problem = _overlap_run(comm, fn, timeout, reverse, case, drawn)
        if problem is not None:
            return (
                problem
                if not reverse
                else (f"with the buckets handed first layer first (bucket 0 now completes last): {problem}")
            )
    return None


def _overlap_run(
    comm: MPI.Comm,
    fn: Callable[..., Callable[[], None]],
    timeout: float,
    reverse: bool,
    case: Training,
    drawn: str = "",
) -> str | None:
    """What is wrong on this rank after the case's SGD steps averaged by fn's hooks, or None."""
    rank, size = comm.Get_rank(), comm.Get_size()
    per_rank, steps, lr = case.per_rank, case.steps, case.lr
    data = StressStrainCurves(n=steps * per_rank * size, seed=case.data_seed, dtype=torch.float64)
    batches = _global_batches(steps, per_rank, size, case.order_seed)
    model = make_mlp(seed=case.model_seed, dtype=torch.float64)
    groups = plan_buckets(list(model.parameters()), case.cap_mb)[:: -1 if reverse else 1]
    lengths = [sum(p.numel() for p in group) for group in groups]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def train_steps(counting: Any) -> list[list[tuple[int, bool]]]:
        recorder = _Recorder(counting)
        finish = fn(model, recorder, groups)
        if not callable(finish):
            raise TypeError(f"overlapped_averaging should return the function finish(), got {type(finish).__name__}")
        if any(getattr(p, "_backward_hooks", None) for p in model.parameters()):  # what register_hook fills
            raise TypeError(f"hooks registered with register_hook run before the gradient reaches p.grad; {HOOK_HINT}")
        per_step = []
        for step, batch in enumerate(batches):
            x, y = data[batch[rank::size]]
            optimizer.zero_grad()
            loss = squared_error(model(x), y).mean()
            recorder.in_backward = True
            try:
                loss.backward()
                recorder.in_backward = False
                finish()
            except Exception as err:
                if step == 0:
                    raise
                raise RuntimeError(
                    f"step {step} failed after step 0 went through ({type(err).__name__}: {err}): {NEXT_STEP_HINT}"
                ) from err
            counts = counting.agree(len(recorder.starts), "the other ranks to finish the step")
            if len(set(counts)) > 1:
                raise ValueError(
                    f"the ranks started {counts} Iallreduces in this step: every rank must start "
                    "every bucket, or the collectives no longer match"
                )
            optimizer.step()
            per_step.append(recorder.starts)
            recorder.starts = []
        return per_step

    try:
        per_step, _ = run_counted(
            comm,
            train_steps,
            (),
            f"{STEPS.get(steps, str(steps))} training steps with overlapped_averaging{drawn}",
            timeout,
            allow=("Iallreduce",),
        )
    except CheckFailed as err:
        if "NoneType" in str(err) and NEXT_STEP_HINT not in str(err):
            raise CheckFailed(f"{err}\n{HOOK_HINT}") from None
        raise
    for step, starts in enumerate(per_step):
        started = [length for length, _ in starts]
        if started != lengths:
            return (
                f"step {step}: Iallreduce calls of {started} elements, expected one per bucket, in bucket order: "
                f"{lengths} (buckets start as 0, 1, 2, ... on every rank: collectives are matched by order)"
            )
        late = [k for k, (_, during) in enumerate(starts) if not during]
        if late:
            return (
                f"step {step}: the Iallreduce of bucket {late[0]} started after backward had returned; start "
                "each bucket from the hook of its last gradient, while backward goes on (that is the overlap)"
            )
    got = [p.detach() for p in model.parameters()]
    worst = max(_relative(g, w) for g, w in zip(got, _one_process(batches, data, lr, case.model_seed)))
    if worst > TOLERANCE:
        summed = _one_process(batches, data, lr * size, case.model_seed)
        hint = (
            ": they match the SUM of the gradients (divide by the number of ranks)"
            if size > 1 and max(_relative(g, w) for g, w in zip(got, summed)) <= TOLERANCE
            else f" ({HOOK_HINT}; and finish() waits for every bucket and writes the averages into p.grad)"
        )
        return (
            f"after {steps} steps the parameters differ from one process with batch {size}x{per_rank} by up to "
            f"{worst:.2e} (relative){hint}"
        )
    return None


def check_overlapped_averaging(fn: Callable[..., Callable[[], None]], timeout: float = TIMEOUT) -> None:
    """fn(model, comm, groups) -> finish: gradients averaged by one Iallreduce per group, each started
    during backward in group order (also when the groups are handed first layer first, so they complete
    in reverse), waited for by finish(); as one process with the global batch, on 3 ranks (not a power
    of two) and on all.

    The grader's draw: the buckets (plan_buckets with a cap from 0.0003 to 1.26 MB: from one bucket per
    tensor to a single one), the ranks (any, in any order) and one more rank count, the batch per rank
    (1 to 16), the steps (2 to 4), SGD's rate and the seeds of the data, the model and the order."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "overlapped_averaging")
    case = drawn_training(draw)
    sizes = _drawn_sizes(world.Get_size(), draw)
    drawn = ""
    if draw is not None:
        buckets = len(plan_buckets(list(make_mlp(dtype=torch.float64).parameters()), case.cap_mb))
        drawn = f", {count(buckets, 'bucket')} (cap {case.cap_mb:g} MB), {case}"
    each_size(
        world,
        lambda sub: _overlap_problem(sub, fn, timeout, case, drawn),
        f"overlapped_averaging{drawn}",
        sizes,
        draw=draw,
    )
    passed(
        world,
        f"overlapped_averaging starts each bucket's Iallreduce during backward, in bucket order whatever "
        "order they complete in, and "
        f"trains as one process does, on {' and '.join(map(str, sizes))} ranks{named(draw)}",
    )


# Exercise 4.6 ---------------------------------------------------------------------


def _allreduce_value_problem(
    comm: MPI.Comm, allreduce: Callable, dtype: type, n: int = 1001, seed: int | None = None, drawn: str = ""
) -> str | None:
    """allreduce(comm, x) on an n-element vector of small integers in `dtype`, held to lab 03's contract
    (the notebook's: 1001 elements of arange % 97 times rank + 1; the grader's: lab 03's drawn inputs of `seed`).

    Through the counting communicator, so an allreduce that deadlocks fails within its timeout."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if seed is None:
        x: np.ndarray = (np.arange(n) % 97 * (rank + 1)).astype(dtype)
        want: np.ndarray = (np.arange(n) % 97 * size * (size + 1) // 2).astype(dtype)
    else:
        inputs = _inputs(n, dtype, size, seed)
        x, want = inputs[rank], sum(inputs[1:], inputs[0].copy())
    before = x.copy()
    context = f"allreduce(comm, x) on {size} ranks, {np.dtype(dtype).name}{drawn}"
    total, _ = run_counted(comm, allreduce, (x,), context)
    return value_problem(total, x, before, want, rank)


@dataclass(frozen=True)
class AllreduceTraining:
    """What check 4.6 runs: lab 03's contract on vectors, then training with the allreduce in buckets.
    The defaults are the notebook's; `seed` None: the notebook's vector, else the grader's data seed."""

    dtypes: tuple[type, ...] = DTYPES
    lengths: tuple[int, ...] = (1001,)
    seed: int | None = None
    cap_mb: float = OVERLAP_CAP_MB
    batch_size: int = 16
    data_seed: int = 4
    model_seed: int = 6

    def __str__(self) -> str:
        return (
            f"vectors of {', '.join(map(str, self.lengths))} elements in "
            f"{', '.join(np.dtype(d).name for d in self.dtypes)} (data seed {self.seed}), then training with "
            f"buckets of at most {self.cap_mb:g} MB, batch {self.batch_size} per rank, data seed {self.data_seed}, "
            f"model seed {self.model_seed}"
        )


def drawn_allreduce_training(draw: Draw | None) -> AllreduceTraining:
    """The notebook's case, or the grader's: lab 03's contract on three dtypes (two of the notebook's and
    one it never shows, as lab 03's checks draw them) and two lengths from 0 to 2000 with drawn data, then
    training with a bucket cap as `_drawn_cap`, a batch of 1 to 16 per rank and drawn seeds."""
    if draw is None:
        return AllreduceTraining()
    return AllreduceTraining(
        dtypes=_drawn_dtypes(draw),
        lengths=tuple(draw.lengths(2, 0, 2000, "lengths")),
        seed=draw.data_seed("vectors"),
        cap_mb=_drawn_cap(draw),
        batch_size=draw.integer(1, 16, "batch"),
        data_seed=draw.data_seed("data"),
        model_seed=draw.data_seed("model"),
    )


def check_trains_with_allreduce(allreduce: Allreduce) -> None:
    """On 3 ranks and on all: lab 03's contract (every dtype, a new array), and DataParallel with this
    allreduce (3 buckets) ends where it ends with MPI's Allreduce.

    The grader's draw: the ranks (any, in any order) and one more rank count; three dtypes (one the
    notebook never shows), two vector lengths from 0 to 2000 and their data; the bucket cap (0.0003 to
    1.26 MB), the batch per rank (1 to 16) and the seeds of the data and the model."""
    world = MPI.COMM_WORLD
    size = world.Get_size()
    draw = grading_draw(world, "trains_with_allreduce")
    case = drawn_allreduce_training(draw)
    drawn = "" if draw is None else f", {case}{named(draw)}"

    def trains(comm: MPI.Comm) -> str | None:
        for dtype in case.dtypes:
            for n in case.lengths:
                fail_together(
                    comm,
                    _allreduce_value_problem(comm, allreduce, dtype, n, case.seed, drawn),
                    f"your allreduce on {comm.Get_size()} ranks, a {n}-element vector"
                    + ("" if draw is None else f" of {np.dtype(dtype).name}, data seed {case.seed}{named(draw)}"),
                )
        per_rank = case.batch_size
        data = StressStrainCurves(n=comm.Get_size() * per_rank * 3, seed=case.data_seed, dtype=torch.float64)
        finals = []
        for choice in (allreduce, None):
            model = make_mlp(seed=case.model_seed, dtype=torch.float64)
            wrapped = DataParallel(model, comm, allreduce=choice, bucket_cap_mb=case.cap_mb)
            optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
            train(wrapped, optimizer, data, comm, epochs=1, batch_size=per_rank, progress=False)
            finals.append([p.detach().clone() for p in model.parameters()])
        worst = max(_relative(a, b) for a, b in zip(*finals))
        return (
            None
            if worst <= TOLERANCE
            else (f"training with your allreduce ends {worst:.2e} (relative) away from training with MPI's Allreduce")
        )

    sizes = _drawn_sizes(size, draw)
    each_size(world, trains, f"training with your allreduce{drawn}", sizes, draw=draw)
    names = ", ".join(np.dtype(d).name for d in case.dtypes[:-1]) + f" and {np.dtype(case.dtypes[-1]).name}"
    passed(
        world,
        f"your allreduce sums {names} into a new array and trains the model to the "
        f"same parameters as MPI_Allreduce, on {' and '.join(map(str, sizes))} ranks{named(draw)}",
    )
