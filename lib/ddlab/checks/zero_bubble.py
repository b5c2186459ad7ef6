"""Checks for lab 17: the split backward, ZB-H1's op list, the executor with W ops, ZB-V's op list.

- `check_split_backward(backward_input, backward_weight)`: on stages of linear layers (with and
  without biases, 2-D and 3-D activations, the first stage whose input needs no gradient, the last
  whose output is a scalar loss), B's input gradient and W's weight gradients must equal the whole
  backward's (float64, 1e-12); B must leave .grad alone, take no weight's gradient (hooks on the parameters),
  and free the graph; W must add into .grad
  (not overwrite it); what B hands to W may hold no more bytes than each linear layer's input and
  output gradient (measured: unique storages, plus any saved tensor of the graph still alive in the
  ledger).
- `check_zb_h1(fn)` and `check_zb_v(fn)`: op lists for p = 1..5 and m = 1..10 (p = 1..4, m = 1..9 for the V),
  multiples of p and not: every op once, F before B before W on each stage, no deadlock when
  replayed (the first violation named), at most 1F1B's peak of activations alive (p micro-batches a
  stage; 2p chunks a rank in the V), and a replay with F = B = W = 1 no longer than the reference's.
  Any order meeting these passes. ZB-V's lists are then run on real ranks: one process's gradients.
- `check_run_zero_bubble(fn)`: the executor under ZB-H1, ZB-H2 and a valid mixed order on P, 3 and 1
  ranks: one process's gradients and losses, one message per micro-batch and direction, and as each B sends
  its gradient back, weight gradients from the W's before it only (no W's work in B); a rank that
  waits in vain fails within the deadline, naming its stage and the op it was running.

Under the grader's draw (ddlab.checks._draw) each check draws its cases instead (its docstring says which),
within what lab 17's text states: the sizes of the op lists, the stages' widths and rows, the micro-batches, the
data's seed, and which ranks run, in which order.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from typing import Any, Callable, Sequence, cast

import torch
from mpi4py import MPI
from torch import nn

from ..pipeline import micro_batch_loss
from ..pipeline.zero_bubble import (
    forward_recorded,
    replay_split,
    run_split,
    tensors_in,
    v_stage,
    zb_h1,
    zb_h2,
    zb_v,
)
from ..runtime.memory import Ledger
from ._core import CheckFailed, count, deadline, each_size, fail_together, is_integer, is_number, passed, run_counted
from ._draw import Draw, grading_draw, named

TIMEOUT = 10.0
WIDTH, ROWS, MICRO = 3, 2, 5


# Exercise 17.1: the split backward ---------------------------------------------------


def _stage_cases(draw: Draw | None = None) -> list[tuple[str, nn.Module, tuple[int, ...], bool, bool]]:
    """(what, stage, input shape, input needs grad, last stage) in float64: the notebook's five, or the grader's
    five of the same kinds with drawn widths, rows and weights (3-D activations (b, s, w) with s unlike w)."""
    if draw is not None:
        return _drawn_stage_cases(draw)
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


def _drawn_stage_cases(draw: Draw) -> list[tuple[str, nn.Module, tuple[int, ...], bool, bool]]:
    """The grader's five stages: the notebook's kinds, widths 1 to 7, 1 to 6 rows, weights of a drawn seed."""
    w = [draw.integer(1, 7, "width", i) for i in range(6)]
    rows = [draw.integer(1, 6, "rows", i) for i in range(4)]
    batch = draw.integer(1, 3, "batch")
    length = draw.choose([n for n in range(1, 7) if n != w[5]], 1, "length")[0]  # unlike the width: axes told apart
    seed = draw.data_seed("weights")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        mlp = nn.Sequential(nn.Linear(w[0], w[1]), nn.Tanh(), nn.Linear(w[1], w[2])).double()
        no_bias = nn.Sequential(nn.Linear(w[3], w[4], bias=False), nn.ReLU(), nn.Linear(w[4], w[0])).double()
        deep = nn.Sequential(
            nn.Linear(w[5], w[1]), nn.GELU(), nn.Linear(w[1], w[2]), nn.Tanh(), nn.Linear(w[2], w[5])
        ).double()
    about = f"weights and data of seed {seed} ({draw})"
    layers = f"linear {w[0]}->{w[1]}, tanh, linear {w[1]}->{w[2]}"
    return [  # the seed of the data (x, the gradients already there, grad_y): the weights' + 1
        (f"a middle stage ({layers}) on {rows[0]} rows, {about}", mlp, (rows[0], w[0]), True, False),
        (
            f"the first stage ({layers}; its input needs no gradient) on {rows[1]} rows, {about}",
            copy.deepcopy(mlp),
            (rows[1], w[0]),
            False,
            False,
        ),
        (
            f"the last stage ({layers}; its output is the loss) on {rows[2]} rows, {about}",
            copy.deepcopy(mlp),
            (rows[2], w[0]),
            True,
            True,
        ),
        (
            f"a stage with a bias-free layer (linear {w[3]}->{w[4]} without bias, relu, linear {w[4]}->{w[0]}) on "
            f"{rows[3]} rows, {about}",
            no_bias,
            (rows[3], w[3]),
            True,
            False,
        ),
        (
            f"three linear layers ({w[5]}->{w[1]}->{w[2]}->{w[5]}) on 3-D activations {(batch, length, w[5])}, {about}",
            deep,
            (batch, length, w[5]),
            True,
            False,
        ),
    ]


def _split_problem(
    backward_input: Callable[..., Any], backward_weight: Callable[..., Any], case: tuple, seed: int = 3
) -> str | None:
    what, stage, shape, needs_grad, last = case
    whole, split = copy.deepcopy(stage), copy.deepcopy(stage)
    generator = torch.Generator().manual_seed(seed)
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
    differentiated: list[int] = []  # the parameters autograd found a gradient of during B
    hooks = [
        q.register_hook(lambda g, index=index: differentiated.append(index))
        for index, q in enumerate(split.parameters())
    ]
    try:
        grad_x, pending = backward_input(y, grad_y, x_split, records)
    finally:
        for hook in hooks:
            hook.remove()
    del y, records
    if any(not torch.equal(q.grad, g) for q, g in zip(split.parameters(), start)):
        return (
            f"{what}: backward_input changed a parameter's .grad; B computes the input's gradient only (W comes later)"
        )
    if differentiated:
        return (
            f"{what}: backward_input differentiated to parameter {min(differentiated)} (a weight's gradient is W's "
            "work): take autograd.grad to x and to each layer's output z only"
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
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors_in(pending)}
    kept, graph = sum(storages.values()), ledger.used["activations"]
    need = sum(a.numel() * 8 + a.shape[:-1].numel() * layer.out_features * 8 for layer, a, _ in _records(stage, x))
    if kept + graph > need:
        return (
            f"{what}: after B, {kept + graph} bytes stay alive for W ({graph} of them saved tensors of a graph "
            f"still kept), but W needs only each linear layer's input and its output's gradient, {need} bytes: "
            "free the graph in B (no retain_graph; a tensor that still has a grad_fn, such as an input a not "
            "detached, keeps the graph behind it) and hand W only those tensors"
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
    """backward_input(y, grad_y, x, records) -> (grad_x, pending) and backward_weight(pending): the split backward.

    The grader's draw: the same five kinds of stage (a middle one, the first, the last with a loss, one with a
    bias-free layer, 3-D activations), in float64, with drawn widths (1 to 7), rows (1 to 6), a 3-D shape
    (b, s, w) whose s is not its w, and weights and data of a drawn seed. Run in the kernel of every rank alike."""
    problem: str | None = None
    draw = grading_draw(MPI.COMM_WORLD, "split_backward")
    current = "the first stage tried"
    seed = 3 if draw is None else draw.data_seed("weights") + 1
    _warm_up()
    try:
        with deadline(3 * TIMEOUT, f"backward_input or backward_weight{named(draw)}"):
            for case in _stage_cases(draw):
                current = case[0]
                problem = _split_problem(backward_input, backward_weight, case, seed)
                if problem:
                    break
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as err:  # the student's code failed: one verdict for every rank
        problem = f"{current}: {type(err).__name__}: {err}"
    fail_together(MPI.COMM_WORLD, problem, "the split backward")
    passed(
        MPI.COMM_WORLD,
        "B gives the input's gradient and W the weights' (equal to the whole backward, float64 1e-12); "
        f"W keeps only each linear layer's input and output gradient{named(draw)}",
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
    draw: Draw | None = None,
) -> None:
    name, chunks = reference.__name__, 1 if shape == "chain" else 2
    unit = "stage" if shape == "chain" else "rank"
    for p, m in sizes:
        context = f"{name}(p={p}, m={m}, ...){named(draw)}"
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
            advice = (
                "Delay W's to fill the idle time (see the lab's text before the exercise)"
                if shape == "chain"
                else "At each step a free rank runs the B of the oldest micro-batch it can, else an F while fewer "
                "than 2p chunk activations are alive (chunk 1 first), else its oldest W (see the lab's text); "
                "rank r's chunk 0 is stage r and its chunk 1 stage 2p - 1 - r (the V), the neighbours to plan with"
            )
            raise CheckFailed(
                f"{context}: with F = B = W = 1 your step takes {took:g}; {name}'s takes {best:g}. {advice}"
            )


def _op_list_sizes(draw: Draw | None, most_p: int, most_m: int) -> list[tuple[int, int]]:
    """(p, m): every p up to most_p with every m up to most_m, or the grader's: (1, 1) and 11 drawn, p up to
    most_p + 2 and m up to most_m + 6 (each exercise takes any p and m: fewer micro-batches than stages among them)."""
    if draw is None:
        return [(p, m) for p in range(1, most_p + 1) for m in range(1, most_m + 1)]
    drawn = [(draw.integer(2, most_p + 2, "p", i), draw.integer(1, most_m + 6, "m", i)) for i in range(10)]
    p = draw.integer(3, most_p + 2, "p", "few")
    return [(1, 1), *drawn, (p, draw.integer(1, p - 1, "m", "few"))]


def check_zb_h1(fn: Callable[[int, int, int], Any]) -> None:
    """fn(p, m, stage) -> ZB-H1's ops for that stage (any valid order as short and as lean as the reference's).

    The grader's draw: 12 (p, m) instead of p = 1..5 with m = 1..10: p up to 7, m up to 16, one with m < p."""
    draw = grading_draw(None, "zb_h1")
    sizes = _op_list_sizes(draw, 5, 10)
    _check_op_lists(fn, zb_h1, "chain", sizes, draw)
    shown = "p = 1..5 and m = 1..10" if draw is None else "12 drawn (p, m) up to 7 and 16"
    passed(
        MPI.COMM_WORLD,
        f"zb_h1: every op once in a valid order for {shown}, at most p micro-batches alive, "
        f"as short as ZB-H1 with F = B = W (m(F + B + W) + (p - 1)(F + B - W) for m >= p){named(draw)}",
    )


# Running: the executor (17.3) and ZB-V on real ranks --------------------------------------


class _Run:
    """What a run on real ranks is given: micro-batches of rows x width in float64, from layers and data of a seed."""

    def __init__(self, draw: Draw | None = None) -> None:
        self.draw = draw
        if draw is None:
            self.micro, self.rows, self.width, self.seed = MICRO, ROWS, WIDTH, 7
        else:
            self.micro, self.rows = draw.integer(2, 6, "micro-batches"), draw.integer(1, 4, "rows")
            self.width, self.seed = draw.integer(1, 5, "width"), draw.data_seed("chain") % 10**6

    def __str__(self) -> str:
        if self.draw is None:
            return ""
        return (
            f", {self.micro} micro-batches of {self.rows} x {self.width} (float64), layers and data of seed "
            f"{self.seed}{named(self.draw)}"
        )

    def chain(self, n: int) -> tuple[list[nn.Module], list[torch.Tensor], list[torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            stages: list[nn.Module] = [
                nn.Sequential(nn.Linear(self.width, 4), nn.Tanh(), nn.Linear(4, self.width)).double() for _ in range(n)
            ]
        shape = (self.rows, self.width)
        inputs = [torch.randn(*shape, dtype=torch.float64, generator=generator) for _ in range(self.micro)]
        targets = [torch.randn(*shape, dtype=torch.float64, generator=generator) for _ in range(self.micro)]
        return stages, inputs, targets


def _one_process(
    stages: list[nn.Module], inputs: list[torch.Tensor], targets: list[torch.Tensor]
) -> tuple[list, list[float]]:
    chain = copy.deepcopy(nn.Sequential(*stages))
    out = chain(torch.cat(inputs))
    micro_batch_loss(out, torch.cat(targets)).backward()
    losses = [micro_batch_loss(y, t).item() for y, t in zip(out.detach().chunk(len(inputs)), targets)]
    return [[q.grad for q in stage.parameters()] for stage in chain], losses


def _each_micro_batch(
    stages: list[nn.Module], inputs: list[torch.Tensor], targets: list[torch.Tensor]
) -> list[list[list[torch.Tensor]]]:
    """Each micro-batch's own weight gradients, [micro-batch][stage][parameter]: what its W adds."""
    found = []
    for x, target in zip(inputs, targets):
        chain = copy.deepcopy(nn.Sequential(*stages))
        micro_batch_loss(chain(x), target).backward()
        found.append([[cast(torch.Tensor, q.grad) for q in stage.parameters()] for stage in chain])
    return found


class _WeightsAtSends:
    """Looks at a stage's weight gradients as each B sends its input's gradient back (the k-th send to the rank
    before is the k-th B of the op list): only the W's before that B in the list may have added to them."""

    def __init__(self, layers: nn.Module, ops: list[tuple], rank: int, each: list[list[torch.Tensor]]) -> None:
        self.layers, self.rank, self.each = layers, rank, each
        self.backs = [(index, op[1]) for index, op in enumerate(ops) if op[0] == "B"]
        self.ops, self.sent = ops, 0
        self.problem: str | None = None

    def _holds(self, batches: list[int]) -> bool:
        """Whether each weight's .grad is the sum of those micro-batches' gradients (None or zero for none)."""
        for n, q in enumerate(self.layers.parameters()):
            got = q.grad
            if not batches:
                if got is not None and bool(got.any()):
                    return False
                continue
            want = torch.stack([self.each[i][n] for i in batches]).sum(0)
            if got is None or got.shape != want.shape or not torch.allclose(got, want, rtol=1e-9, atol=1e-12):
                return False
        return True

    def sent_to(self, peer: int, tag: int) -> None:
        if peer != self.rank - 1 or self.sent >= len(self.backs) or self.problem is not None:
            return
        position, i = self.backs[self.sent]
        self.sent += 1
        done = [op[1] for op in self.ops[:position] if op[0] == "W"]
        if self._holds(done):
            return
        backs = [j for _, j in self.backs[: self.sent]]
        self.problem = (
            f"stage {self.rank}: when B of micro-batch {i} sent its input's gradient, the weights' .grad "
            + (
                "already held the gradients of every micro-batch whose B had run, its own too: the weights' "
                "gradients were computed in B (call your 17.1 B there, and your W only at the W ops)"
                if self._holds(backs)
                else f"was not the sum of what the W's before it in the ops added (micro-batches {done or 'none'})"
            )
        )


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


def _sizes(draw: Draw | None = None) -> list[int]:
    """The world's size first (an answer on the notebook's world completes there), then 3 and 1 ranks; the
    grader's: the world's size, then two other counts drawn (their ranks drawn by each_size)."""
    size = MPI.COMM_WORLD.Get_size()
    if draw is None:
        return [size] + [k for k in (3, 1) if k < size]
    return [size] + draw.choose(range(size - 1, 0, -1), 2, "sizes")


def check_run_zero_bubble(fn: Callable[..., Any], timeout: float = TIMEOUT) -> None:
    """fn(comm, layers, ops, inputs, targets) runs this rank's stage through F, B and W ops; one process's gradients.

    timeout: seconds a rank may wait for a message before the answer fails as stalled.
    The grader's draw: the world's ranks and two other counts, each in a drawn order; 2 to 6 micro-batches of
    1 to 4 rows x 1 to 5 features (float64, the text's dtype); layers and data of a drawn seed."""
    draw = grading_draw(MPI.COMM_WORLD, "run_zero_bubble")
    run = _Run(draw)

    def body(sub: MPI.Comm) -> str | None:
        k, rank = sub.Get_size(), sub.Get_rank()
        stages, inputs, targets = run.chain(k)
        want, want_losses = _one_process(stages, inputs, targets)
        each = [grads[rank] for grads in _each_micro_batch(stages, inputs, targets)]
        for schedule in (zb_h1, zb_h2, mixed_split):
            layers = copy.deepcopy(stages[rank])
            listed = [tuple(op) for op in schedule(k, run.micro, rank)]
            ops, at_sends = _Watched(listed), _WeightsAtSends(layers, listed, rank, each)
            args = (layers, ops, [x.clone() for x in inputs], [t.clone() for t in targets])
            context = f"run_zero_bubble under {schedule.__name__} on {count(k, 'rank')}{run}"
            try:
                losses, traffic = run_counted(sub, fn, args, context, timeout=timeout, on_send=at_sends.sent_to)
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
            expected = Counter({peer: run.micro for peer in (rank - 1, rank + 1) if 0 <= peer < k})
            problem = None if sent == expected else f"sent {dict(sent)} messages per rank; expected {dict(expected)}"
            if problem and not sent:
                problem += " (none went through `comm`: sent on the notebook's MPI.COMM_WORLD instead?)"
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
                "B sends the input's gradient; each W adds its micro-batch's weight gradients once; a message taken "
                "for another micro-batch's op gives wrong gradients too (receive with the micro-batch as tag)",
            )
            fail_together(sub, at_sends.problem, f"{context}: the backward not split")
            if rank < k - 1:
                problem = (
                    None
                    if isinstance(losses, (list, tuple)) and not losses
                    else f"returned {losses!r}; ranks before the last return []"
                )
            elif (
                not isinstance(losses, (list, tuple))
                or len(losses) != run.micro
                or not all(is_number(v) for v in losses)
            ):
                problem = (
                    f"returned {losses!r}; the last rank returns the {run.micro} losses in micro-batch order, as "
                    "floats (loss.item())"
                )
            elif not all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(losses, want_losses)):
                problem = (
                    f"losses {[round(float(v), 6) for v in losses]}, expected {[round(v, 6) for v in want_losses]}"
                )
            fail_together(sub, problem, f"{context}: wrong losses")
        return None

    sizes = _sizes(draw)
    each_size(MPI.COMM_WORLD, body, "run_zero_bubble", sizes=sizes, draw=draw)
    passed(
        MPI.COMM_WORLD,
        f"run_zero_bubble gives one process's gradients under ZB-H1, ZB-H2 and a mixed order on "
        f"{', '.join(map(str, sizes))} stages{named(draw)}",
    )


def check_zb_v(fn: Callable[[int, int, int], Any]) -> None:
    """fn(p, m, rank) -> ZB-V's ops (kind, chunk, i) for that rank; checked as an op list, then run on real ranks.

    The grader's draw: 12 (p, m) instead of p = 1..4 with m = 1..9 (p up to 6, m up to 15, one with m < p);
    the run on the world's ranks and two other counts in drawn orders, with drawn micro-batches (2 to 6), their
    shape, and layers and data of a drawn seed."""
    draw = grading_draw(MPI.COMM_WORLD, "zb_v")
    run, sizes = _Run(draw), _sizes(draw)
    lists = _op_list_sizes(draw, 4, 9) + ([] if draw is None else [(k, run.micro) for k in sizes])  # those run too
    _check_op_lists(fn, zb_v, "V", lists, draw)

    def body(sub: MPI.Comm) -> str | None:
        p, rank = sub.Get_size(), sub.Get_rank()
        stages, inputs, targets = run.chain(2 * p)
        want, _ = _one_process(stages, inputs, targets)
        mine = [v_stage(p, rank, 0), v_stage(p, rank, 1)]
        chunks = [copy.deepcopy(stages[q]) for q in mine]
        ops = [tuple(op) for op in fn(p, run.micro, rank)]
        run_counted(
            sub,
            lambda comm: run_split(comm, chunks, ops, inputs, targets, shape="V"),
            (),
            f"zb_v's ops run{run}",
            timeout=TIMEOUT,
        )
        fail_together(sub, _grad_problem(chunks, [want[q] for q in mine]), f"zb_v's ops on {count(p, 'rank')}{run}")
        return None

    each_size(MPI.COMM_WORLD, body, "zb_v", sizes=sizes, draw=draw)
    shown = "p = 1..4 and m = 1..9" if draw is None else "12 drawn (p, m) up to 6 and 15"
    passed(
        MPI.COMM_WORLD,
        f"zb_v: valid V op lists for {shown}, at most 2p chunk activations a rank, as short as "
        f"the reference's; run on real ranks they give one process's gradients{named(draw)}",
    )
