"""Run a pipeline schedule on the lab 06 stages, and measure it: timeline, bubble, activation memory.

A step cuts the batch into M micro-batches and runs, on each rank, the ops its
schedule lists. Gradients of the micro-batches add up in the parameters, so a
step's gradient is the whole batch's, whatever the schedule (the loss of each
micro-batch is scaled by 1 / pixels of the whole batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model_parallel import Stage, Timeline, polite_barrier, utilisation
from ..model_parallel.timeline import BUSY_KINDS, kind_totals
from ..models.unet import UNet
from ..runtime.comm import Comm
from ..runtime.counting import underlying
from ..runtime.memory import Ledger
from ..runtime.trace import Span, gather_spans
from .schedules import Schedule, bubble, simulate


def micro_batches(images: torch.Tensor, masks: torch.Tensor, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batch cut into m equal micro-batches, each with storage of its own.

    (Views into the batch would share its storage, and memory accounting, which
    counts storages, would charge the whole batch for any micro-batch kept.)
    """
    if m < 1 or images.shape[0] % m:
        raise ValueError(f"a batch of {images.shape[0]} cannot be cut into {m} equal micro-batches")
    return [(x.clone(), y.clone()) for x, y in zip(images.chunk(m), masks.chunk(m))]


def pipeline_step(
    stage: Stage,
    schedule: Schedule,
    images: torch.Tensor,
    masks: torch.Tensor,
    m: int,
    optimizer: torch.optim.Optimizer | None = None,
) -> float | None:
    """One step on the batch as m micro-batches, ops in the order schedule(K, m, stage) gives.

    Returns the batch's loss on the last stage, None elsewhere.
    """
    parts = micro_batches(images, masks, m)
    scale = 1.0 / masks.numel()
    for kind, i in schedule(stage.plan.k, m, stage.index):
        if kind == "F":
            stage.forward(i, *parts[i], scale)
        elif kind == "B":
            stage.backward(i)
        else:
            raise ValueError(f"unknown op {(kind, i)!r}: ops are ('F', i) or ('B', i)")
    if stage.in_flight():
        raise ValueError(
            f"stage {stage.index}: the schedule never ran the backward of micro-batches {stage.in_flight()}"
        )
    stage.mailbox.flush()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return sum(stage.losses.pop(i) for i in range(m)) if stage.last else None


@dataclass
class PipelineRun:
    """A measured pipeline step: every rank's timeline on both clocks, stage times and peak activations.

    The timelines are those of the repeat with the shortest busy-clock makespan (the
    one other programs disturbed least); a stage's time is its shortest over the
    repeats, since a busy machine can only make an operation look slower.
    """

    schedule: str
    m: int
    bounds: list[int]
    recompute: bool
    busy: list[list[Span]] = field(repr=False)
    wall: list[list[Span]] = field(repr=False)
    stage_times: list[float]
    peak_activations: list[int]

    @property
    def bubble(self) -> float:
        """Idle share on the busy clock (one core per rank)."""
        return utilisation(self.busy)["bubble"]

    @property
    def wall_bubble(self) -> float:
        return utilisation(self.wall)["bubble"]

    @property
    def makespan(self) -> float:
        """Seconds the step takes on the busy clock."""
        return utilisation(self.busy)["makespan"]

    @property
    def directions(self) -> list[tuple[float, float]]:
        """Per stage, (forward, backward) compute seconds of the step (messages excluded), on the busy clock."""
        return [(kinds["forward"], kinds["backward"]) for kinds in map(kind_totals, self.busy)]

    @property
    def imbalance(self) -> float:
        """Slowest stage time over the mean: 1 for perfectly balanced stages."""
        return max(self.stage_times) / (sum(self.stage_times) / len(self.stage_times))


def hidden_share(run: PipelineRun) -> float:
    """1 - makespan / busy time of all stages, on the busy clock: for M = 1, the work done off the critical path.

    With one micro-batch the stages can only take turns, so if each op were one
    indivisible block the step would last the sum of their busy times. It lasts
    less: an op's set-up before its first receive, its work after its last send
    (autograd finishing the weight gradients), and a backward's start on a skip's
    gradient that arrived early all run while another stage computes.
    """
    busy = utilisation(run.busy)["busy"]
    return 1 - run.makespan / sum(busy)


def expected_bubble(run: PipelineRun, schedule: Schedule) -> float:
    """The bubble this schedule would have with the run's own stage times (uneven stages included).

    Each stage's time per micro-batch is split between forward and backward as its
    measured compute was, and the schedule is replayed with those times (`simulate`).
    """
    k = len(run.stage_times)
    forward, backward = [], []
    for spans, total in zip(run.busy, run.stage_times):
        kinds = kind_totals(spans)
        share = kinds["forward"] / max(kinds["forward"] + kinds["backward"], 1e-12)
        forward.append(total / run.m * share)
        backward.append(total / run.m * (1 - share))
    return bubble(simulate([schedule(k, run.m, s) for s in range(k)], forward, backward))


def _stage_time(spans: list[Span]) -> float:
    return sum(s.duration for s in spans if s.name in BUSY_KINDS)


def measure_pipeline(
    comm: Comm,
    model: UNet,
    bounds: list[int],
    schedule: Schedule,
    m: int,
    images: torch.Tensor,
    masks: torch.Tensor,
    recompute: bool = False,
    warmup: int = 1,
    repeats: int = 3,
) -> PipelineRun:
    """Run `warmup` steps, then measure `repeats` more. A collective: every rank gets the same result."""
    raw = underlying(comm)
    rank = raw.Get_rank()
    clock, ledger = Timeline(rank), Ledger(stage=f"stage {rank}")
    stage = Stage(model, bounds, comm, tuple(images.shape[1:]), ledger=ledger, clock=clock, recompute=recompute)
    best: tuple[list[list[Span]], list[list[Span]]] | None = None
    times, peak = [], 0
    for step in range(warmup + repeats):
        polite_barrier(comm, pause=1e-4)  # ranks leave it within a fraction of a millisecond
        ledger.reset_peak()
        clock.start()
        pipeline_step(stage, schedule, images, masks, m)
        if step < warmup:
            continue
        busy, wall = gather_spans(clock.busy, raw), gather_spans(clock.wall, raw)
        times.append([_stage_time(spans) for spans in busy])
        peak = max(peak, ledger.peak["activations"])
        if best is None or utilisation(busy)["makespan"] < utilisation(best[0])["makespan"]:
            best = (busy, wall)
    stage.mailbox.free()
    stage_times = [min(per_stage) for per_stage in zip(*times)]
    assert best is not None, "repeats must be at least 1"
    busy, wall = best
    return PipelineRun(schedule.__name__, m, list(bounds), recompute, busy, wall, stage_times, raw.allgather(peak))
