"""Lab 17's measurements: each schedule run on real ranks, its bubble beside the formulas, its peak memory.

`measure_split(comm, name, m)` runs one of SCHEDULES on stages of linear layers (one or two chunks a
rank) for `repeats` steps after a warm-up, and returns a `SplitRun`: every rank's busy-clock
timeline of the fastest step, the measured F, B and W times (busy clock, medians over ops and
ranks), and each rank's peak activation bytes from the ledger. `predicted(run)` replays the
schedule's op lists with the run's own F, B, W times (`replay_split`); `closed_form(run)` is the
schedule's formula where it has one.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..model_parallel import Timeline, polite_barrier, utilisation
from ..runtime.comm import Comm
from ..runtime.counting import underlying
from ..runtime.memory import Ledger
from ..runtime.trace import Span, gather_spans
from .interleaved import interleaved_1f1b
from .zero_bubble import (
    SplitOp,
    backward_input,
    bubble_1f1b,
    bubble_zb_h1,
    bubble_zb_h2,
    forward_recorded,
    hold_for_w,
    one_f_one_b_whole,
    placed,
    replay_split,
    run_split,
    split_bubble,
    zb_h1,
    zb_h2,
    zb_v,
)


def interleaved_whole(p: int, m: int, rank: int) -> list[SplitOp]:
    """Lab 16's interleaved 1F1B with two chunks a rank, each backward whole (("BW", chunk, i))."""
    return [("BW", c, i) if kind == "B" else (kind, c, i) for kind, c, i in interleaved_1f1b(p, m, rank, 2)]


#: name -> (op list of (p, m, rank), shape)
SCHEDULES: dict[str, tuple[Callable[[int, int, int], list[SplitOp]], str]] = {
    "1F1B": (one_f_one_b_whole, "chain"),
    "interleaved": (interleaved_whole, "interleaved"),
    "ZB-H1": (zb_h1, "chain"),
    "ZB-H2": (zb_h2, "chain"),
    "ZB-V": (zb_v, "V"),
}


#: name -> a stage's layers of (width, hidden): "tanh" (linear, tanh, linear), W keeping twice what the
#: forward saved; "post_norm" (linear, GELU, linear, a layer norm without weights: a transformer's MLP
#: block and its norm), W keeping no more than the forward saved, as in Qi et al.'s Table 1.
BLOCKS: dict[str, Callable[[int, int], list[nn.Module]]] = {
    "tanh": lambda width, hidden: [nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, width)],
    "post_norm": lambda width, hidden: [
        nn.Linear(width, hidden),
        nn.GELU(),
        nn.Linear(hidden, width),
        nn.LayerNorm(width, elementwise_affine=False),
    ],
}


def stages(n: int, width: int, hidden: int, dtype: torch.dtype = torch.float32, block: str = "tanh") -> list[nn.Module]:
    """n stages of `block` (one of BLOCKS), the same on every rank (seeded)."""
    if block not in BLOCKS:
        raise ValueError(f"unknown block {block!r}: one of {', '.join(BLOCKS)}")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return [nn.Sequential(*BLOCKS[block](width, hidden)).to(dtype) for _ in range(n)]


def held_bytes(
    block: str, width: int = 64, hidden: int = 256, rows: int = 32, dtype: torch.dtype = torch.float32
) -> tuple[int, int]:
    """(M_B, M_W) of one stage of `block` on `rows` rows of `dtype`, from the ledger: the activation bytes
    a micro-batch holds from its F until its B (what autograd saved), and from its B until its W (each
    linear layer's input a and output gradient g). One process."""
    stage = stages(1, width, hidden, dtype, block)[0]
    ledger = Ledger()
    ledger.ignore(stage)
    x = torch.randn(rows, width, dtype=dtype, requires_grad=True)
    with ledger.activations():
        y, records = forward_recorded(stage, x)
    saved = ledger.used["activations"]
    _, pending = backward_input(y, torch.ones_like(y), x, records)
    del y, records
    hold_for_w(ledger, pending)
    return saved, ledger.used["activations"]


@dataclass
class SplitRun:
    """One schedule measured: busy-clock timelines, F/B/W seconds per op (one chunk's), peak activation bytes per rank."""

    name: str
    p: int
    m: int
    busy: list[list[Span]] = field(repr=False)
    times: tuple[float, float, float]
    peaks: list[int]
    makespans: list[float]
    block: str = "tanh"

    @property
    def bubble(self) -> float:
        """Idle share of ranks x makespan on the busy clock (the fastest step)."""
        return utilisation(self.busy)["bubble"]

    @property
    def makespan(self) -> float:
        return min(self.makespans)


def _op_times(spans: list[list[Span]]) -> tuple[float, float, float]:
    """Median seconds of one F, one B and one W over every rank's ops (busy clock, waits excluded).

    A whole backward ("BW") is split between B and W as the split ones of the same run are, or counted
    as B + W = its time with W = 0 when the run has none."""
    per: dict[str, list[float]] = {"forward": [], "backward": [], "weight": []}
    for rank in spans:
        totals: dict[tuple[str, int | None], float] = {}
        for s in rank:
            if s.name in per:
                totals[(s.name, s.number)] = totals.get((s.name, s.number), 0.0) + s.duration
        for (name, _), seconds in totals.items():
            per[name].append(seconds)
    f, b = statistics.median(per["forward"]), statistics.median(per["backward"])
    return f, b, statistics.median(per["weight"]) if per["weight"] else 0.0


def measure_split(
    comm: Comm,
    name: str,
    m: int,
    width: int = 64,
    hidden: int = 256,
    rows: int = 32,
    warmup: int = 1,
    repeats: int = 3,
    block: str = "tanh",
) -> SplitRun:
    """Run schedule `name` of SCHEDULES for warmup + repeats steps of m micro-batches on stages of `block`
    (one of BLOCKS); a collective.

    Per op times are per chunk (two chunks a rank hold a stage's layers each in the V and interleaved
    runs, so the model has twice the layers there: compare bubbles, which are shares, not makespans)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: one of {', '.join(SCHEDULES)}")
    schedule, shape = SCHEDULES[name]
    raw = underlying(comm)
    p, rank = raw.Get_size(), raw.Get_rank()
    chunks_per_rank = 1 if shape == "chain" else 2
    models = stages(p * chunks_per_rank, width, hidden, block=block)
    mine = [copy.deepcopy(models[placed(shape, p, rank, c)]) for c in range(chunks_per_rank)]
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(rows, width, generator=gen) for _ in range(m)]
    targets = [torch.randn(rows, width, generator=gen) for _ in range(m)]
    ops = schedule(p, m, rank)
    clock, ledger = Timeline(rank), Ledger(stage=f"rank {rank}")
    best: list[list[Span]] | None = None
    makespans, peak = [], 0
    for step in range(warmup + repeats):
        polite_barrier(comm, pause=1e-4)
        ledger.reset_peak()
        run_split(comm, mine, ops, inputs, targets, shape=shape, clock=clock, ledger=ledger)
        for chunk in mine:
            chunk.zero_grad(set_to_none=False)
        if step < warmup:
            continue
        busy = gather_spans(clock.busy, raw)
        makespans.append(utilisation(busy)["makespan"])
        peak = max(peak, ledger.peak["activations"])
        if best is None or makespans[-1] <= min(makespans):
            best = busy
    assert best is not None, "repeats must be at least 1"
    return SplitRun(name, p, m, best, _op_times(best), raw.allgather(peak), makespans, block)


def predicted(run: SplitRun) -> float:
    """The bubble of the run's schedule replayed with the run's own F, B, W times (messages free)."""
    schedule, shape = SCHEDULES[run.name]
    f, b, w = run.times
    if w == 0.0:  # a whole-backward run: no W measured apart; B holds B + W
        return split_bubble(replay_split([schedule(run.p, run.m, r) for r in range(run.p)], f, b, 0.0, shape))
    return split_bubble(replay_split([schedule(run.p, run.m, r) for r in range(run.p)], f, b, w, shape))


def closed_form(run: SplitRun, split_times: tuple[float, float, float] | None = None) -> float | None:
    """The schedule's bubble formula with (F, B, W) (the run's own, or `split_times` for whole-backward
    runs, whose backward the formula needs split), or None for ZB-V (no closed form here: see `predicted`)."""
    f, b, w = split_times or run.times
    p, m = run.p, run.m
    if run.name == "1F1B":
        return bubble_1f1b(p, m, f, b, w)
    if run.name == "interleaved":
        idle = (p - 1) * (f + b + w)  # per chunk op times: a chunk is half a stage, so (p - 1)/v of a stage's ops
        return idle / (2 * m * (f + b + w) + idle)
    if run.name == "ZB-H1":
        return bubble_zb_h1(p, m, f, b, w)
    if run.name == "ZB-H2":
        return bubble_zb_h2(p, m, f, b, w)
    return None
