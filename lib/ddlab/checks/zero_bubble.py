"""Checks for lab 17: the split backward, ZB-H1's op list, the executor with W ops, ZB-V's op list.

- `check_split_backward(backward_input, backward_weight)`: on stages of linear layers (with and
  without biases, 2-D and 3-D activations, the first stage whose input needs no gradient, the last
  whose output is a scalar loss), B's input gradient and W's weight gradients must equal the whole
  backward's (float64, 1e-12); B must leave .grad alone and free the graph; W must add into .grad
  (not overwrite it); what B hands to W may hold no more bytes than each linear layer's input and
  output gradient (measured: unique storages, plus any saved tensor of the graph still alive in the
  ledger).
- `check_zb_h1(fn)` and `check_zb_v(fn)`: op lists for p = 1..5 and m = 1..10 (p = 1..4, m = 1..9 for the V),
  multiples of p and not: every op once, F before B before W on each stage, no deadlock when
  replayed (the first violation named), at most 1F1B's peak of activations alive (p micro-batches a
  stage; 2p chunks a rank in the V), and a replay with F = B = W = 1 no longer than the reference's.
  Any order meeting these passes. ZB-V's lists are then run on real ranks: one process's gradients.
- `check_run_zero_bubble(fn)`: the executor under ZB-H1, ZB-H2 and a valid mixed order on P, 3 and 1
  ranks: one process's gradients and losses, one message per micro-batch and direction; a rank that
  waits in vain fails within the deadline, naming its stage and the op it was running.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from typing import Any, Callable, Sequence

import torch
from mpi4py import MPI
from torch import nn

from ..pipeline import micro_batch_loss
from ..pipeline.zero_bubble import forward_recorded, replay_split, run_split, v_stage, zb_h1, zb_h2, zb_v
from ..runtime.memory import Ledger
from ._core import CheckFailed, count, deadline, each_size, fail_together, is_integer, is_number, passed, run_counted

TIMEOUT = 10.0
WIDTH, ROWS, MICRO = 3, 2, 5


# Exercise 17.1: the split backward ---------------------------------------------------


def _stage_cases() -> list[tuple[str, nn.Module, tuple[int, ...], bool, bool]]:
    """(what, stage, input shape, input needs grad, last stage) in float64."""
    with torch.random.fork_rng():
        torch.manual_seed(11)
        mlp = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()
        no_bias = nn.Sequential(nn.Linear(4, 6, bias=False), nn.ReLU(), nn.Linear(6, 2)).double()
        deep = nn.Sequential(nn.Linear(3, 3), nn.GELU(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)).double()
    return [
        ("a middle stage (linear, tanh, linear)", mlp, (4, 3), True, False),
        ("the first stage (its input needs no gradient)", copy.deepcopy(mlp), (4, 3), False, False),
        ("the last stage (its output is the loss)", copy.deepcopy(mlp), (4, 3), True, True),
        ("a stage with a bias-free layer", no_bias, (3, 4), True, False),
        ("three linear layers on 3-D activations (2, 3, 3)", deep, (2, 3, 3), True, False),
    ]


def _unique_bytes(obj: Any, seen: dict[int, int]) -> None:
    if isinstance(obj, torch.Tensor):
        if not isinstance(obj, nn.Parameter):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    elif isinstance(obj, dict):
        for value in obj.values():
            _unique_bytes(value, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _unique_bytes(value, seen)


def _split_problem(backward_input: Callable[..., Any], backward_weight: Callable[..., Any], case: tuple) -> str | None:
    what, stage, shape, needs_grad, last = case
    whole, split = copy.deepcopy(stage), copy.deepcopy(stage)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, dtype=torch.float64, generator=generator)
    start = [torch.randn(q.shape, dtype=torch.float64, generator=generator) for q in stage.parameters()]
    for model in (whole, split):  # gradients already there: W must add to them
        for q, g in zip(model.parameters(), start):
            q.grad = g.clone()
    x_whole = x.clone().requires_grad_(needs_grad)
    out = whole(x_whole)
    grad_y = None if last else torch.randn(out.shape, dtype=torch.float64, generator=generator)
    (out.square().sum() if last else out).backward(grad_y)

    x_split = x.clone().requires_grad_(needs_grad)
    ledger = Ledger()
    ledger.ignore(split)
    with ledger.activations():
        y, records = forward_recorded(split, x_split)
    if last:
        y = y.square().sum()
    grad_x, pending = backward_input(y, grad_y, x_split, records)
    del y, records
    if any(not torch.equal(q.grad, g) for q, g in zip(split.parameters(), start)):
        return (
            f"{what}: backward_input changed a parameter's .grad; B computes the input's gradient only (W comes later)"
        )
    if needs_grad:
        if not isinstance(grad_x, torch.Tensor) or grad_x.shape != x.shape or grad_x.dtype != x.dtype:
            return f"{what}: backward_input returned {type(grad_x).__name__} as the input's gradient; expected a {tuple(x.shape)} float64 tensor"
        assert x_whole.grad is not None, "the whole backward reached the input"
        if not torch.allclose(grad_x, x_whole.grad, rtol=0, atol=1e-12):
            worst = float((grad_x - x_whole.grad).abs().max())
            return f"{what}: the input's gradient differs from the whole backward's by up to {worst:.2e}"
    elif grad_x is not None:
        return f"{what}: the input needs no gradient, so backward_input returns None as grad_x, got {type(grad_x).__name__}"
    seen: dict[int, int] = {}
    _unique_bytes(pending, seen)
    kept, graph = sum(seen.values()), ledger.used["activations"]
    need = sum(a.numel() * 8 + a.shape[:-1].numel() * layer.out_features * 8 for layer, a, _ in _records(stage, x))
    if kept + graph > need:
        return (
            f"{what}: after B, {kept + graph} bytes stay alive for W ({graph} of them saved tensors of a graph "
            f"still kept), but W needs only each linear layer's input and its output's gradient, {need} bytes: "
            "free the graph in B (no retain_graph) and hand W only those tensors"
        )
    backward_weight(pending)
    for index, (got, want) in enumerate(zip(split.parameters(), whole.parameters())):
        assert want.grad is not None, "the whole backward reached every parameter"
        if got.grad is None or not torch.allclose(got.grad, want.grad, rtol=0, atol=1e-12):
            how = "no gradient" if got.grad is None else f"up to {float((got.grad - want.grad).abs().max()):.2e}"
            return (
                f"{what}: after W, parameter {index} ({tuple(got.shape)}) differs from the whole backward's ({how}); "
                "W adds g^T a to each weight's .grad and g summed over rows to each bias's, once"
            )
    return None


def _records(stage: nn.Module, x: torch.Tensor) -> list:
    with torch.no_grad():
        return forward_recorded(stage, x)[1]


def _warm_up() -> None:
    """One backward before any deadline: torch imports parts of itself (sympy) on its first backward, which a
    deadline interrupting it on a busy machine would leave half imported."""
    x = torch.ones(1, requires_grad=True)
    (2 * x).sum().backward()


def check_split_backward(backward_input: Callable[..., Any], backward_weight: Callable[..., Any]) -> None:
    """backward_input(y, grad_y, x, records) -> (grad_x, pending) and backward_weight(pending): the split backward."""
    problem: str | None = None
    _warm_up()
    try:
        with deadline(3 * TIMEOUT, "backward_input or backward_weight"):
            for case in _stage_cases():
                problem = _split_problem(backward_input, backward_weight, case)
                if problem:
                    break
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as err:  # the student's code failed: one verdict for every rank
        problem = f"{type(err).__name__}: {err}"
    fail_together(MPI.COMM_WORLD, problem, "the split backward")
    passed(
        MPI.COMM_WORLD,
        "B gives the input's gradient and W the weights' (equal to the whole backward, float64 1e-12); "
        "W keeps only each linear layer's input and output gradient",
    )


# Op lists: ZB-H1 (17.2) and ZB-V (17.4) -------------------------------------------------


def _show(ops: Any, limit: int = 14) -> str:
    if not isinstance(ops, list):
        return repr(ops)
    return " ".join("".join(map(str, op)) if isinstance(op, tuple) else repr(op) for op in ops[:limit]) + (
        " ..." if len(ops) > limit else ""
    )


def _ops_problem(got: Any, m: int, chunks: int, who: str) -> str | None:
    """Every op once, well formed, and F before B before W for each (chunk, micro-batch) of this rank."""
    width = 2 if chunks == 1 else 3
    if not isinstance(got, (list, tuple)):
        return f"{who}: returned {type(got).__name__}; return a list of ops"
    ops = [tuple(op) if isinstance(op, (list, tuple)) else op for op in got]
    for position, op in enumerate(ops):
        ok = isinstance(op, tuple) and len(op) == width and op[0] in ("F", "B", "W")
        ok = ok and all(is_integer(v) for v in op[1:]) and 0 <= op[-1] < m and (width == 2 or 0 <= op[1] < chunks)
        if not ok:
            form = "(kind, i)" if width == 2 else "(kind, chunk, i) with chunk 0 or 1"
            return f"{who}: op {position} is {op!r}; ops are {form}, kind 'F', 'B' or 'W', 0 <= i < m={m}"
    seen: Counter = Counter(ops)
    twice = [op for op, n in seen.items() if n > 1]
    if twice:
        return f"{who}: {twice[0]} appears {seen[twice[0]]} times; each op runs once"
    for c in range(chunks):
        for i in range(m):
            for kind in ("F", "B", "W"):
                missing = (kind, i) if width == 2 else (kind, c, i)
                if missing not in seen:
                    return f"{who}: {missing} is missing; every micro-batch needs an F, a B and a W"
    index = {op: n for n, op in enumerate(ops)}
    for position, op in enumerate(ops):
        before = {"F": None, "B": "F", "W": "B"}[op[0]]
        if before is not None:
            need = (before, *op[1:])
            if index[need] > position:
                return f"{who}: {op} at position {position} comes before {need} (position {index[need]}): {_show(ops)}"
    return None


def _check_op_lists(
    fn: Callable[[int, int, int], Any],
    reference: Callable[[int, int, int], Any],
    shape: str,
    sizes: Sequence[tuple[int, int]],
) -> None:
    name, chunks = reference.__name__, 1 if shape == "chain" else 2
    unit = "stage" if shape == "chain" else "rank"
    for p, m in sizes:
        context = f"{name}(p={p}, m={m}, ...)"
        try:
            with deadline(TIMEOUT, context):
                got = [fn(p, m, r) for r in range(p)]
        except (NotImplementedError, CheckFailed):
            raise
        except Exception as err:
            raise CheckFailed(f"{context} raised {type(err).__name__}: {err}") from None
        for r, ops in enumerate(got):
            problem = _ops_problem(ops, m, chunks, f"{context} for {unit} {r}")
            if problem:
                raise CheckFailed(problem)
        lists = [[tuple(op) for op in ops] for ops in got]
        try:
            timeline = replay_split(lists, 1.0, 1.0, 1.0, shape)
        except ValueError as err:
            raise CheckFailed(
                f"{context}: {str(err).replace('rank', unit)}: an op waits for one that its neighbour runs later "
                "(F needs the previous stage's F, B the next stage's B)"
            ) from None
        limit = p if shape == "chain" else 2 * p
        for r, ops in enumerate(lists):
            alive = 0
            for position, op in enumerate(ops):
                alive += {"F": 1, "B": 0, "W": -1}[op[0]]
                if alive > limit:
                    return_msg = (
                        f"{context}: {unit} {r} has {alive} activations alive (F done, W not yet) at op {position} "
                        f"{op}; at most {limit} ({'p micro-batches' if shape == 'chain' else '2p chunks'}, "
                        "1F1B's peak) may be"
                    )
                    raise CheckFailed(return_msg)
        took = max(end for ops in timeline for _, _, end in ops)
        best = max(
            end
            for ops in replay_split([reference(p, m, r) for r in range(p)], 1.0, 1.0, 1.0, shape)
            for _, _, end in ops
        )
        if took > best + 1e-9:
            raise CheckFailed(
                f"{context}: with F = B = W = 1 the step takes {took:g}; {name} takes {best:g}. "
                "Delay W's to fill the idle time (see the lab's text before the exercise)"
            )


def check_zb_h1(fn: Callable[[int, int, int], Any]) -> None:
    """fn(p, m, stage) -> ZB-H1's ops for that stage (any valid order as short and as lean as the reference's)."""
    sizes = [(p, m) for p in range(1, 6) for m in range(1, 11)]
    _check_op_lists(fn, zb_h1, "chain", sizes)
    passed(
        MPI.COMM_WORLD,
        "zb_h1: every op once in a valid order for p = 1..5 and m = 1..10, at most p micro-batches alive, "
        "as short as ZB-H1 with F = B = W (m(F + B + W) + (p - 1)(F + B - W) for m >= p)",
    )


# Running: the executor (17.3) and ZB-V on real ranks --------------------------------------


def _chain(n: int) -> tuple[list[nn.Module], list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        stages: list[nn.Module] = [
            nn.Sequential(nn.Linear(WIDTH, 4), nn.Tanh(), nn.Linear(4, WIDTH)).double() for _ in range(n)
        ]
    inputs = [torch.randn(ROWS, WIDTH, dtype=torch.float64, generator=generator) for _ in range(MICRO)]
    targets = [torch.randn(ROWS, WIDTH, dtype=torch.float64, generator=generator) for _ in range(MICRO)]
    return stages, inputs, targets


def _one_process(
    stages: list[nn.Module], inputs: list[torch.Tensor], targets: list[torch.Tensor]
) -> tuple[list, list[float]]:
    chain = copy.deepcopy(nn.Sequential(*stages))
    out = chain(torch.cat(inputs))
    micro_batch_loss(out, torch.cat(targets)).backward()
    losses = [micro_batch_loss(y, t).item() for y, t in zip(out.detach().chunk(MICRO), targets)]
    return [[q.grad for q in stage.parameters()] for stage in chain], losses


def _grad_problem(chunks: list[nn.Module], want: list[list[torch.Tensor]]) -> str | None:
    for c, (chunk, expected) in enumerate(zip(chunks, want)):
        for index, (q, w) in enumerate(zip(chunk.parameters(), expected)):
            if q.grad is None:
                return f"chunk {c}, parameter {index} has no gradient (a W missing?)"
            if not torch.allclose(q.grad, w, rtol=1e-9, atol=1e-12):
                ratio = float(q.grad.norm() / w.norm()) if float(w.norm()) else math.nan
                return (
                    f"chunk {c}, parameter {index}'s gradient differs from one process's by up to "
                    f"{float((q.grad - w).abs().max()):.2e} (norm ratio {ratio:.3g}: 2 means a W ran twice)"
                )
    return None


def mixed_split(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """A valid order unlike the schedules: all F's, the B's newest first on even stages, then the W's newest first."""
    order = list(range(m))[::-1] if stage % 2 == 0 else list(range(m))
    return [("F", i) for i in range(m)] + [("B", i) for i in order] + [("W", i) for i in range(m)][::-1]


class _Watched(list):
    """The ops handed to an executor, remembering the last one it took (for a stall's message)."""

    current: tuple | None = None

    def __iter__(self) -> Any:
        for op in super().__iter__():
            self.current = op
            yield op

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        if isinstance(index, int):
            self.current = item
        return item


def _sizes() -> list[int]:
    """The world's size first (an answer on the notebook's world completes there), then 3 and 1 ranks."""
    size = MPI.COMM_WORLD.Get_size()
    return [size] + [k for k in (3, 1) if k < size]


def check_run_zero_bubble(fn: Callable[..., Any], timeout: float = TIMEOUT) -> None:
    """fn(comm, layers, ops, inputs, targets) runs this rank's stage through F, B and W ops; one process's gradients.

    timeout: seconds a rank may wait for a message before the answer fails as stalled."""

    def body(sub: MPI.Comm) -> str | None:
        k, rank = sub.Get_size(), sub.Get_rank()
        stages, inputs, targets = _chain(k)
        want, want_losses = _one_process(stages, inputs, targets)
        for schedule in (zb_h1, zb_h2, mixed_split):
            layers = copy.deepcopy(stages[rank])
            ops = _Watched(tuple(op) for op in schedule(k, MICRO, rank))
            args = (layers, ops, [x.clone() for x in inputs], [t.clone() for t in targets])
            context = f"run_zero_bubble under {schedule.__name__} on {count(k, 'rank')}"
            try:
                losses, traffic = run_counted(sub, fn, args, context, timeout=timeout)
            except CheckFailed as err:
                where = sub.allgather(ops.current)
                stalled = any(word in str(err) for word in ("Stalled", "never waited"))
                extra = (
                    "".join(f"\n  stage {r} was running op {op}" for r, op in enumerate(where) if op is not None)
                    if stalled
                    else ""
                )
                raise CheckFailed(f"{err}{extra}") from None
            sent = Counter(e.peer for e in traffic[rank].sends)
            expected = Counter({peer: MICRO for peer in (rank - 1, rank + 1) if 0 <= peer < k})
            problem = None if sent == expected else f"sent {dict(sent)} messages per rank; expected {dict(expected)}"
            fail_together(
                sub,
                problem,
                f"{context}: wrong messages",
                "one activation forward and one gradient back per micro-batch",
            )
            problem = _grad_problem([layers], [want[rank]])
            fail_together(
                sub,
                problem,
                f"{context}: wrong gradients",
                "B sends the input's gradient; each W adds its micro-batch's weight gradients once",
            )
            if rank < k - 1:
                problem = (
                    None
                    if isinstance(losses, (list, tuple)) and not losses
                    else f"returned {losses!r}; ranks before the last return []"
                )
            elif not isinstance(losses, (list, tuple)) or len(losses) != MICRO or not all(is_number(v) for v in losses):
                problem = f"returned {losses!r}; the last rank returns the {MICRO} losses in micro-batch order"
            elif not all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(losses, want_losses)):
                problem = (
                    f"losses {[round(float(v), 6) for v in losses]}, expected {[round(v, 6) for v in want_losses]}"
                )
            fail_together(sub, problem, f"{context}: wrong losses")
        return None

    each_size(MPI.COMM_WORLD, body, "run_zero_bubble", sizes=_sizes())
    passed(
        MPI.COMM_WORLD,
        f"run_zero_bubble gives one process's gradients under ZB-H1, ZB-H2 and a mixed order on "
        f"{', '.join(map(str, _sizes()))} stages",
    )


def check_zb_v(fn: Callable[[int, int, int], Any]) -> None:
    """fn(p, m, rank) -> ZB-V's ops (kind, chunk, i) for that rank; checked as an op list, then run on real ranks."""
    sizes = [(p, m) for p in range(1, 5) for m in range(1, 10)]
    _check_op_lists(fn, zb_v, "V", sizes)

    def body(sub: MPI.Comm) -> str | None:
        p, rank = sub.Get_size(), sub.Get_rank()
        stages, inputs, targets = _chain(2 * p)
        want, _ = _one_process(stages, inputs, targets)
        mine = [v_stage(p, rank, 0), v_stage(p, rank, 1)]
        chunks = [copy.deepcopy(stages[q]) for q in mine]
        ops = [tuple(op) for op in fn(p, MICRO, rank)]
        run_counted(
            sub,
            lambda comm: run_split(comm, chunks, ops, inputs, targets, shape="V"),
            (),
            "zb_v's ops run",
            timeout=TIMEOUT,
        )
        fail_together(sub, _grad_problem(chunks, [want[q] for q in mine]), f"zb_v's ops on {count(p, 'rank')}")
        return None

    each_size(MPI.COMM_WORLD, body, "zb_v", sizes=_sizes())
    passed(
        MPI.COMM_WORLD,
        "zb_v: valid V op lists for p = 1..4 and m = 1..9, at most 2p chunk activations a rank, as short as "
        "the reference's; run on real ranks they give one process's gradients",
    )
