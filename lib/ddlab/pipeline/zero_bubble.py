"""Zero-bubble pipelines (lab 17): the backward split into B and W, and the schedules that use the split.

Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (section 2, figure 1): a stage's backward
is two computations. B, the gradient with respect to the stage's input, is what the previous stage
waits for; W, the gradients with respect to the stage's weights, nobody waits for. For a linear
layer z = a w^T + b with the gradient g of z, B is g w (through the graph, down to the input) and
W is w.grad += g^T a, b.grad += g summed over rows: W needs each weight layer's input a and the
gradient g of its output, nothing else of the graph.

- `forward_recorded(layers, x)`: a stage's forward that records each nn.Linear's input and output.
- `backward_input(y, grad_y, x, records)` (B, exercise 17.1's reference with `backward_weight`):
  the gradient of x and what W needs; `backward_weight(pending)` (W) adds the weight gradients.
- Op lists, ("F", i), ("B", i), ("W", i) per stage: `one_f_one_b_whole` (1F1B, ("BW", i) the whole
  backward, the gradient sent after W),
  `zb_h1` (exercise 17.2's reference), `zb_h2`; with two chunks per rank in a V, ("F", chunk, i),
  ...: `zb_v` (exercise 17.4's reference).
- `replay_split`: replay per-rank op lists with F, B, W times (messages free), `split_spans` for its
  Gantt chart; `split_bubble`,
  `split_peak`, `split_peak_bytes`: a replay's idle share, a rank's most activations alive and their
  bytes from M_B and M_W; the closed forms
  `bubble_1f1b`, `bubble_zb_h1`, `bubble_zb_h2`.
- `run_split` (exercise 17.3's reference on a chain): run the op lists on real ranks (with a ledger,
  `hold_for_w` charges what W keeps from its B until it runs);
  `run_split_data_parallel`: a schedule on a mesh's pipeline dimension, data parallel over its data one.

Exercise 17.1 signatures: `backward_input(y, grad_y, x, records) -> (grad_x, pending)` with
records the list of (linear, a, z) that `forward_recorded` returns, grad_x None when x does not
require grad, pending a list of (linear, a, g); `backward_weight(pending) -> None`.
Exercise 17.2: `zb_h1(p, m, stage) -> list of ("F" | "B" | "W", i)`.
Exercise 17.3: `run_zero_bubble(comm, layers, ops, inputs, targets) -> losses` (as lab 07's
`run_schedule`, with W ops). Exercise 17.4: `zb_v(p, m, rank) -> list of (kind, chunk, i)`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from mpi4py import MPI
from torch import nn

from ..model_parallel import Mailbox, Timeline
from ..runtime.comm import Comm
from ..runtime.memory import Ledger
from ..runtime.reference import reference
from ..runtime.trace import Span
from .executor import micro_batch_loss
from .schedules import one_f_one_b, replay

Record = tuple[nn.Linear, torch.Tensor, torch.Tensor]  # a linear layer, its input a, its output z
Pending = tuple[nn.Linear, torch.Tensor, torch.Tensor]  # a linear layer, its input a, the gradient g of z
SplitOp = tuple  # ("F" | "B" | "W", i) on a chain, ("F" | "B" | "W", chunk, i) with chunks
KINDS = ("F", "B", "W", "BW")


def forward_recorded(layers: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[Record]]:
    """y = layers(x), and each nn.Linear's (layer, input, output) in the order they ran.

    The weights of the stage must all belong to nn.Linear layers (the split W is written for them)."""
    for name, module in layers.named_modules():
        own = list(module.parameters(recurse=False))
        if own and not isinstance(module, nn.Linear):
            raise ValueError(
                f"layer {name or type(module).__name__} ({type(module).__name__}) has weights but is not an "
                "nn.Linear: the split backward here computes W for linear layers only; use stages of nn.Linear "
                "layers and weightless activations"
            )
    records: list[Record] = []

    def keep(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        records.append((module, args[0], out))  # type: ignore[arg-type]

    handles = [m.register_forward_hook(keep) for m in layers.modules() if isinstance(m, nn.Linear)]
    try:
        y = layers(x)
    finally:
        for handle in handles:
            handle.remove()
    return y, records


@reference("split_backward")
def backward_input(
    y: torch.Tensor, grad_y: torch.Tensor | None, x: torch.Tensor, records: list[Record]
) -> tuple[torch.Tensor | None, list[Pending]]:
    """B: the gradient of x (None if x does not require grad) and, per linear layer, (layer, a, g) for W.

    One pass of autograd to x and to every linear layer's output z, none to the weights; the graph
    is freed after it, so only what W needs stays alive: each layer's input a and the gradient g of z.
    grad_y: the gradient of y (None when y is the last stage's scalar loss)."""
    wanted = ([x] if x.requires_grad else []) + [z for _, _, z in records]
    grads = torch.autograd.grad(y, wanted, grad_y)
    grad_x = grads[0] if x.requires_grad else None
    gs = grads[1:] if x.requires_grad else grads
    return grad_x, [(layer, a.detach(), g) for (layer, a, _), g in zip(records, gs)]


@reference("split_backward")
def backward_weight(pending: list[Pending]) -> None:
    """W: add each linear layer's weight gradient g^T a (and bias gradient, g summed) into .grad."""
    for layer, a, g in pending:
        a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
        grads = [(layer.weight, g2.T @ a2)] + ([(layer.bias, g2.sum(0))] if layer.bias is not None else [])
        for param, grad in grads:
            if param.grad is None:
                param.grad = grad.clone()
            else:
                param.grad += grad


# Op lists ---------------------------------------------------------------------


def _sizes(p: int, m: int, stage: int) -> None:
    if p < 1 or m < 1 or not 0 <= stage < p:
        raise ValueError(
            f"need p >= 1 stages, m >= 1 micro-batches and 0 <= stage < p, got p={p}, m={m}, stage={stage}"
        )


def _lagged(ops: list[tuple[str, int]], m: int, lag: int) -> list[SplitOp]:
    """The F and B ops with W(j) right after B(j + lag), and the W's left over at the end."""
    out: list[SplitOp] = []
    w = 0
    for kind, i in ops:
        out.append((kind, i))
        if kind == "B" and i >= lag:
            out.append(("W", w))
            w += 1
    return out + [("W", j) for j in range(w, m)]


def one_f_one_b_whole(p: int, m: int, stage: int) -> list[SplitOp]:
    """1F1B (lab 07) with the whole backward as one op, ("BW", i): B and W, then the input's gradient is sent."""
    return [("BW", i) if kind == "B" else (kind, i) for kind, i in one_f_one_b(p, m, stage)]


@reference("zb_h1")
def zb_h1(p: int, m: int, stage: int) -> list[SplitOp]:
    """ZB-H1 (Qi et al. 2024, section 2.1, figure 3): 1F1B's forwards and B's, stage s running each W
    s B's late (the rest at the end). At most p micro-batches alive (F done, W not) on any stage,
    1F1B's peak; with m >= p the step lasts m (F + B + W) + (p - 1)(F + B - W)."""
    _sizes(p, m, stage)
    return _lagged(one_f_one_b(p, m, stage), m, stage)


def zb_h2(p: int, m: int, stage: int) -> list[SplitOp]:
    """ZB-H2 (Qi et al. 2024, section 2.2, figure 3): 2(p - s) - 1 warm-up forwards fill the start,
    then F and B in turn with each W 2s B's late, the W's left filling the end. Up to 2p micro-batches
    alive (F done, W not) on a stage, counting the forward that runs just before each stage's first B:
    twice 1F1B's p."""
    _sizes(p, m, stage)
    warmup = min(2 * (p - stage) - 1, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(m - warmup, m)]
    return _lagged(ops, m, 2 * stage)


def v_stage(p: int, rank: int, chunk: int) -> int:
    """In a V, chunk 0 of rank r is virtual stage r and chunk 1 is stage 2p - 1 - r (rank 0 holds the first and last)."""
    return rank if chunk == 0 else 2 * p - 1 - rank


SHAPES = ("chain", "V", "interleaved")


def placed(shape: str, p: int, rank: int, chunk: int) -> int:
    """The virtual stage of chunk `chunk` of `rank`: on a chain rank r is stage r; in a V see `v_stage`;
    interleaved (lab 16, two chunks) chunk c of rank r is stage c p + r."""
    if shape not in SHAPES:
        raise ValueError(f"shape is one of {SHAPES}, got {shape!r}")
    if shape == "V":
        return v_stage(p, rank, chunk)
    return chunk * p + rank


def owner(shape: str, p: int, q: int) -> int:
    """The rank holding virtual stage q."""
    return (q if q < p else 2 * p - 1 - q) if shape == "V" else q % p


@reference("zb_v")
def zb_v(p: int, m: int, rank: int) -> list[SplitOp]:
    """A V-shaped zero-bubble schedule (the placement of ZB-V, Qi et al., "Pipeline Parallelism with
    Controllable Memory", 2024, section 3), ops ("F" | "B" | "W", chunk, i).

    Built by running every rank greedily on unit op times: a rank free at time t runs the oldest B it
    can (chunk 1 first), else the next F it can while fewer than 2p chunk activations are alive on it
    (1F1B's p stages' worth), chunk 1 first, else its oldest pending W. The same for every rank."""
    _sizes(p, m, rank)
    return _greedy_v(p, m)[rank]


def _greedy_v(p: int, m: int) -> list[list[SplitOp]]:
    n, limit = 2 * p, 2 * p
    where = [(q, 0) if q < p else (n - 1 - q, 1) for q in range(n)]
    end: dict[tuple[str, int, int], int] = {}
    free_at, alive = [0] * p, [0] * p
    next_f = [0] * n
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    ops: list[list[SplitOp]] = [[] for _ in range(p)]
    t, left = 0, 3 * n * m
    while left:
        for r in range(p):
            if free_at[r] > t:
                continue
            mine = sorted((q for q in range(n) if where[q][0] == r), reverse=True)  # chunk 1 first
            choice: tuple[str, int, int] | None = None
            for i in range(m):
                for q in mine:
                    ready = ("F", q, i) in end and ("B", q, i) not in end
                    if ready and (q == n - 1 or end.get(("B", q + 1, i), t + 1) <= t) and end[("F", q, i)] <= t:
                        choice = choice or ("B", q, i)
            if choice is None and alive[r] < limit:
                for q in mine:
                    i = next_f[q]
                    if choice is None and i < m and (q == 0 or end.get(("F", q - 1, i), t + 1) <= t):
                        choice = ("F", q, i)
            if choice is None and pending[r]:
                choice = ("W", *pending[r].pop(0))
            if choice is None:
                continue
            kind, q, i = choice
            end[choice], free_at[r], left = t + 1, t + 1, left - 1
            ops[r].append((kind, where[q][1], i))
            if kind == "F":
                next_f[q] += 1
                alive[r] += 1
            elif kind == "B":
                pending[r].append((q, i))
            else:
                alive[r] -= 1
        t += 1
    return ops


# Replay and formulas -------------------------------------------------------------


def _parts(op: Sequence) -> tuple[str, int, int]:
    return (op[0], 0, op[1]) if len(op) == 2 else (op[0], op[1], op[2])


def replay_split(
    schedules: Sequence[Sequence[SplitOp]], f: float, b: float, w: float, shape: str = "chain"
) -> list[list[tuple[SplitOp, float, float]]]:
    """Per rank, (op, start, end) of op lists run with op times f, b, w (messages free).

    shape "chain": rank r is stage r (ops ("F", i)); "V" and "interleaved": ops ("F", chunk, i), chunk c
    of rank r being virtual stage `placed(shape, p, r, c)`.
    F(q, i) needs F(q - 1, i); B(q, i) needs F(q, i) and B(q + 1, i); W(q, i) needs B(q, i); BW(q, i),
    B and W in one op of b + w, needs what B needs. Lab 07's `schedules.replay` with W ops.
    ValueError on a deadlock, naming each stuck rank and the op it waits at."""
    p = len(schedules)
    placed(shape, p, 0, 0)  # a known shape
    return replay(
        [[tuple(op) for op in ops] for ops in schedules],
        [f] * p,
        [b] * p,
        v=1 if shape == "chain" else 2,
        unit="rank",
        weight=[w] * p,
        place=lambda p_, r, c: placed(shape, p_, r, c),
        what="op lists",
    )


def split_spans(timeline: Sequence[Sequence[tuple[SplitOp, float, float]]]) -> list[list[Span]]:
    """A replayed timeline as spans (forward, backward, weight; numbered by micro-batch) for `ddlab.plots.gantt`."""
    names = {"F": "forward", "B": "backward", "W": "weight", "BW": "backward"}
    return [
        [Span(names[op[0]], start, end, rank=r, number=op[-1]) for op, start, end in ops]
        for r, ops in enumerate(timeline)
    ]


def split_bubble(timeline: Sequence[Sequence[tuple[SplitOp, float, float]]]) -> float:
    """Idle share of ranks x makespan of a replayed timeline."""
    makespan = max(end for ops in timeline for _, _, end in ops)
    busy = sum(end - start for ops in timeline for _, start, end in ops)
    return 1 - busy / (len(timeline) * makespan)


def split_peak(ops: Sequence[SplitOp]) -> int:
    """The most micro-batches (or chunk activations) alive at once on a rank: F done, W not yet."""
    alive = most = 0
    for op in ops:
        alive += {"F": 1, "B": 0, "W": -1, "BW": -1}[op[0]]
        most = max(most, alive)
    return most


def split_peak_bytes(ops: Sequence[SplitOp], m_b: float, m_w: float) -> float:
    """A rank's peak activation bytes from its op list: m_b for each micro-batch (or chunk) whose F ran and
    B not yet, m_w for each whose B ran and W not yet (a whole backward "BW" frees it at once).

    ZB-H1 keeps at most p micro-batches alive, as 1F1B does, so its peak is 1F1B's when m_w <= m_b
    (Qi et al. 2024, Table 1: W needs less activation memory than B for a transformer layer); when m_w > m_b
    the stages that hold W's late pay the difference."""
    waiting_b = waiting_w = 0
    most = 0.0
    for op in ops:
        kind = op[0]
        waiting_b += {"F": 1, "B": -1, "W": 0, "BW": -1}[kind]
        waiting_w += {"F": 0, "B": 1, "W": -1, "BW": 0}[kind]
        most = max(most, waiting_b * m_b + waiting_w * m_w)
    return most


def _share(p: int, m: int, f: float, b: float, w: float, idle: float) -> float:
    """Idle share when each rank works m (f + b + w) and idles `idle` in a step."""
    return idle / (m * (f + b + w) + idle)


def bubble_1f1b(p: int, m: int, f: float, b: float, w: float) -> float:
    """1F1B with the whole backward (B and W) before the gradient is sent: idle (p - 1)(F + B + W) per rank."""
    return _share(p, m, f, b, w, (p - 1) * (f + b + w))


def bubble_zb_h1(p: int, m: int, f: float, b: float, w: float) -> float:
    """ZB-H1 (Qi et al. 2024, section 2.1): idle (p - 1)(F + B - W) per rank, for m >= p and W <= F + B."""
    return _share(p, m, f, b, w, (p - 1) * (f + b - w))


def bubble_zb_h2(p: int, m: int, f: float, b: float, w: float) -> float:
    """ZB-H2: idle (p - 1) max(F, F + B - 2W) per rank, for m >= 2p (the replay of its op list agrees there).

    Qi et al. (section 2.2) give (p - 1)(F + B - 2W) counting the parallelogram their figure 3 draws;
    with every rank finishing the step together (the optimizer step here), the last stage cannot start
    before p - 1 forwards have run, hence the max."""
    return _share(p, m, f, b, w, (p - 1) * max(f, f + b - 2 * w))


# Running on real ranks ---------------------------------------------------------------


def tensors_in(pending: object) -> list[torch.Tensor]:
    """The tensors in what B hands W (any nesting of lists, tuples and dicts; parameters left out)."""
    if isinstance(pending, torch.Tensor):
        return [] if isinstance(pending, nn.Parameter) else [pending]
    items = pending.values() if isinstance(pending, dict) else pending if isinstance(pending, (list, tuple)) else ()
    return [tensor for item in items for tensor in tensors_in(item)]


def hold_for_w(ledger: Ledger, pending: object) -> None:
    """Charge what W keeps alive (each layer's input a and output gradient g) until W drops it.

    A function, not a loop in the executor: a loop's variables would keep the last a and g alive
    after W ran (and the ledger would rightly count them)."""
    for tensor in tensors_in(pending):
        ledger.hold(tensor, "a tensor W keeps")


@reference("run_zero_bubble")
def run_split(
    comm: Comm,
    chunks: list[nn.Module],
    ops: Sequence[SplitOp],
    inputs: list[torch.Tensor],
    targets: list[torch.Tensor],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = micro_batch_loss,
    shape: str = "chain",
    clock: Timeline | None = None,
    ledger: Ledger | None = None,
) -> list[float]:
    """Run this rank's split ops on its chunks (one on a chain, two in a V or interleaved); gradients add up in .grad.

    Every activation has inputs[i]'s shape and dtype. The first virtual stage takes inputs[i], the
    last computes `loss` against targets[i] and its rank returns the losses in micro-batch order ([]
    elsewhere). Messages are posted without waiting and tagged by receiving stage, micro-batch and
    direction; a hand-over between two chunks of one rank (the middle of a V) stays on the rank.
    With a `clock`, F, B, W are forward, backward and weight spans; with a `ledger`, the forwards'
    saved tensors and what W keeps alive are charged as activations."""
    placed(shape, 1, 0, 0)  # a known shape
    mailbox = Mailbox(comm, clock=clock)
    r, p, m = mailbox.rank, mailbox.size, len(inputs)
    n = p if shape == "chain" else 2 * p
    if len(chunks) != n // p:
        raise ValueError(f"a {shape} needs {n // p} chunk(s) per rank, got {len(chunks)}")

    def tag(q: int, i: int, backward: bool) -> int:  # q: the stage that receives
        return 2 * (q * m + i) + int(backward)

    if ledger is not None:
        for chunk in chunks:
            ledger.ignore(chunk)  # the weights autograd saves are parameters, not activations
    local: dict[tuple[int, int, bool], torch.Tensor] = {}

    def send(t: torch.Tensor, q: int, i: int, backward: bool) -> None:
        if owner(shape, p, q) == r:
            local[(q, i, backward)] = t.detach().clone()
        else:
            mailbox.post(t, owner(shape, p, q), tag(q, i, backward))

    def take(shape_: tuple[int, ...], dtype: torch.dtype, q_from: int, q: int, i: int, backward: bool) -> torch.Tensor:
        if owner(shape, p, q_from) == r:
            return local.pop((q, i, backward))
        return mailbox.take(shape_, dtype, owner(shape, p, q_from), tag(q, i, backward))

    kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, list[Record]]] = {}
    waiting_w: dict[tuple[int, int], list[Pending]] = {}
    losses: dict[int, float] = {}
    names = {"F": "forward", "B": "backward", "W": "weight"}
    for op in ops:
        kind, c, i = _parts(op)
        if kind not in KINDS:
            raise ValueError(
                f"unknown op {tuple(op)!r}: ops are ('F', i), ('B', i), ('W', i), ('BW', i) (with a chunk in a V)"
            )
        q = placed(shape, p, r, c)
        with mailbox.clock.span(names[kind[0]], i):
            if kind == "F":
                like = inputs[i]
                x = like if q == 0 else take(tuple(like.shape), like.dtype, q - 1, q, i, False).requires_grad_()
                with ledger.activations() if ledger is not None else contextlib.nullcontext():
                    y, records = forward_recorded(chunks[c], x)
                if q == n - 1:
                    y = loss(y, targets[i])
                    losses[i] = y.item()
                else:
                    send(y, q + 1, i, False)
                kept[(q, i)] = (x, y, records)
            elif kind in ("B", "BW"):
                x, y, records = kept.pop((q, i))
                grad = None if q == n - 1 else take(tuple(y.shape), y.dtype, q + 1, q, i, True)
                grad_x, pending = backward_input(y, grad, x, records)
                del x, y, records
                if ledger is not None and kind == "B":
                    hold_for_w(ledger, pending)
                if kind == "BW":
                    backward_weight(pending)
                else:
                    waiting_w[(q, i)] = pending
                if grad_x is not None:
                    send(grad_x, q - 1, i, True)
                del pending  # from here only waiting_w keeps W's inputs, so W frees them when it runs
            else:
                backward_weight(waiting_w.pop((q, i)))
    if kept or waiting_w:
        raise ValueError(
            f"rank {r}: the ops never ran B of {sorted(kept)} or W of {sorted(waiting_w)} ((stage, micro-batch) pairs)"
        )
    mailbox.free()
    return [losses[i] for i in sorted(losses)]


def run_split_data_parallel(
    pipeline: Comm,
    data: Comm,
    chunks: list[nn.Module],
    schedule: Callable[[int, int, int], Sequence[SplitOp]],
    inputs: list[torch.Tensor],
    targets: list[torch.Tensor],
    shape: str = "V",
) -> list[float]:
    """One step of a schedule on a mesh's pipeline dimension, data parallel over its data dimension.

    The D data replicas share the m micro-batches (replica d takes micro-batches d, d + D, ...); each runs
    `schedule(P, its count, pipeline rank)` on its pipeline of P ranks (`run_split`, `shape` as there: "V"
    for `zb_v`), then every gradient is summed over `data` (the loss of lab 07 is a sum over
    micro-batches), so that each rank's chunks hold one process's gradients of the whole batch. Returns
    the losses of this replica's micro-batches on the rank holding the last stage ([] elsewhere)."""
    d, replicas = data.Get_rank(), data.Get_size()
    if len(inputs) < replicas or len(targets) != len(inputs):
        raise ValueError(
            f"need as many targets as inputs and at least one micro-batch per data replica: "
            f"{len(inputs)} inputs, {len(targets)} targets, {replicas} replicas"
        )
    mine, theirs = inputs[d::replicas], targets[d::replicas]
    ops = schedule(pipeline.Get_size(), len(mine), pipeline.Get_rank())
    losses = run_split(pipeline, chunks, ops, mine, theirs, shape=shape)
    for chunk in chunks:
        for param in chunk.parameters():
            if param.grad is None:
                raise ValueError("a chunk's parameter got no gradient: its stage never ran a backward")
            grad = param.grad.contiguous()
            data.Allreduce(MPI.IN_PLACE, grad.numpy(), op=MPI.SUM)
            param.grad = grad
    return losses
