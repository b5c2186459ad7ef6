"""Predict, then run: each strategy of labs 04-08 on this machine's ranks, measured against the oracle.

Every `run_<strategy>(comm, platform, ...)` is a collective: rank 0 profiles the layers'
compute alone (ParaDL's per-layer times from one device), and for lab 08's spatial and
filter layers what their implementation adds (its own work and its exchanges' curves:
`ddlab.oracle.implementation`), all before the run; the oracle predicts, then all
ranks train `steps` steps of the real implementation of that lab under a `Ledger`.
Measured: wall seconds per step (from a common start after a barrier to the last rank's
end; median over steps after one warm-up) and each rank's peak bytes (the ledger's four
parts; lab 04's bucket buffers are the gradients' storage, so the ledger sees them).
Every rank gets the same `Validation`.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, cast

import torch
from mpi4py import MPI
from torch import nn

from ..model_parallel import Crossings, polite_barrier
from ..runtime.comm import Comm
from ..runtime.memory import Ledger
from .describe import ModelInfo, describe, profile_seconds
from .implementation import LocalComm, LocalHalo, filter_curves, halo_curve, overhead_per_exchange
from .measure import measure_sync
from .platform import Curves, Platform
from .strategies import Prediction, data, pipeline, unet_edges

Curve = tuple[list[float], list[float]]  # (sizes in bytes, seconds)

LR = 0.01


def accuracy(predicted: float, measured: float) -> float:
    """ParaDL's accuracy: 1 - |predicted - measured| / measured."""
    return 1.0 - abs(predicted - measured) / measured


@dataclass
class Validation:
    """A strategy's prediction and what its run measured (memory per rank as the ledger's parts + buffers)."""

    prediction: Prediction
    seconds: float
    memory: list[dict[str, int]]
    rank_kind: list[int]  # which entry of prediction.memory describes each rank

    @property
    def name(self) -> str:
        return self.prediction.label

    @property
    def time_accuracy(self) -> float:
        return accuracy(self.prediction.time, self.seconds)

    def predicted_peak(self, rank: int) -> float:
        return sum(self.prediction.memory[self.rank_kind[rank]].values())

    def measured_peak(self, rank: int) -> int:
        return self.memory[rank]["peak"]

    @property
    def memory_accuracies(self) -> list[float]:
        return [accuracy(self.predicted_peak(r), self.measured_peak(r)) for r in range(len(self.memory))]

    @property
    def memory_accuracy(self) -> float:
        """The worst rank's."""
        return min(self.memory_accuracies)


def _profile(
    comm: MPI.Comm,
    make: Callable[[], tuple[nn.Module, torch.Tensor, Callable]],
    name: str,
    sample_shape: tuple[int, ...],
    platform: Platform,
    pieces: int = 1,
    rounds: int = 5,
) -> tuple[ModelInfo, Platform]:
    """Rank 0 describes the model and profiles it alone on one rank's work; the contention of that work.

    `make()` returns (model, the batch one rank computes, loss). When a rank computes
    1/pieces of each sample (a slab), the batch holds slabs and the seconds are scaled
    back to whole samples, so that the small slabs' own speed is what the oracle uses.
    Then, in `rounds` alternating rounds, rank 0 runs the same work alone and every rank
    runs it at once, so that load drifting on a shared machine affects both alike. The
    layers' seconds are scaled so that their sum is the median time alone (the profile
    gives the split among layers, the rounds the level), and the platform's contention
    becomes this workload's: c(P) = (median time with all P ranks computing, slowest
    rank) / (median time alone), c(n) linear between 1 and c(P). So a step with every
    rank busy is predicted to compute what the rounds measured with every rank busy.
    (A matrix product contends less for memory bandwidth than a network's many small
    layers; on a shared machine both change by the minute.) `sync` is measured again too.
    Every rank gets the same (ModelInfo, Platform).
    """
    torch.manual_seed(0)
    model, batch, loss = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    info = None
    if comm.Get_rank() == 0:
        info = profile_seconds(describe(model, sample_shape, name, loss=loss), model, batch, loss, optimizer, repeats=3)
        layers = tuple(
            replace(
                layer, seconds_forward=layer.seconds_forward * pieces, seconds_backward=layer.seconds_backward * pieces
            )
            for layer in info.layers
        )
        info = replace(info, layers=layers)

    def work() -> float:
        start = time.perf_counter()
        loss(model(batch)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    alone, together = [], []
    for _ in range(rounds):
        polite_barrier(comm)
        alone.append(work() if comm.Get_rank() == 0 else 0.0)
        polite_barrier(comm)
        together.append(comm.allreduce(work(), op=MPI.MAX))
    level = comm.bcast(statistics.median(alone), root=0)
    p = comm.Get_size()
    worst = max(1.0, statistics.median(together) / level)
    contention = tuple(1.0 + (worst - 1.0) * (n - 1) / max(p - 1, 1) for n in range(1, p + 1))
    sync = comm.bcast(measure_sync(comm), root=0)
    info = comm.bcast(info, root=0)
    return info.scaled(level / info.step_seconds(batch.shape[0] / pieces)), replace(
        platform, contention=contention, sync=sync
    )


def timed_steps(comm: MPI.Comm, step: Callable[[], object], steps: int) -> float:
    """Median wall seconds of a step, from a common start to the last rank's end, after one warm-up."""
    raw = comm
    times = []
    for i in range(steps + 1):
        polite_barrier(raw, pause=1e-4)
        start = raw.bcast(time.perf_counter(), root=0)
        step()
        end = raw.allreduce(time.perf_counter(), op=MPI.MAX)
        if i:
            times.append(end - start)
    return statistics.median(times)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


# Lab 04: data parallelism --------------------------------------------------------------------
def run_data(
    comm: MPI.Comm,
    platform: Platform,
    batch: int = 256,
    hidden: tuple[int, ...] = (1024, 1024, 512),
    steps: int = 5,
    rounds: int = 5,
) -> Validation:
    """lab 04's DataParallel on an MLP of `hidden` widths, batch B split over the ranks."""
    from ..data_parallel import DataParallel
    from ..models import make_mlp

    p = comm.Get_size()
    local = batch // p
    x, y = torch.randn(batch, 600), torch.randn(batch, 2)
    loss = lambda out: ((out - torch.zeros_like(out)) ** 2).sum(dim=1).mean()  # noqa: E731  (the run's, shapes alike)
    info, platform = _profile(
        comm, lambda: (make_mlp(hidden=hidden), x[:local].clone(), loss), "MLP", (600,), platform, rounds=rounds
    )
    prediction = data(info, batch, p, platform, bucket_buffers=False)  # the gradients are views of the buckets
    module = make_mlp(hidden=hidden)
    optimizer = _sgd(module.parameters())
    ledger = Ledger(stage=f"rank {comm.Get_rank()}")
    ledger.watch(module, optimizer)  # first: its gradient hook sees each autograd gradient, not a bucket view
    model = DataParallel(module, comm)
    rows = slice(comm.Get_rank() * local, (comm.Get_rank() + 1) * local)
    mine = (x[rows].clone(), y[rows].clone())  # own storage: a view would be charged the whole batch

    def step() -> None:
        with ledger.activations():
            value = ((model(mine[0]) - mine[1]) ** 2).sum(dim=1).mean()
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    seconds = timed_steps(comm, step, steps)
    ledger.close()
    model.remove_hooks()
    return Validation(prediction, seconds, comm.allgather({**ledger.report(), "buffers": 0}), [0] * p)


# Labs 06-07: layer and pipeline parallelism -------------------------------------------------------
def _unet_loss(masks: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The UNet's loss for profiling: cross-entropy against a target of the output's own size and storage."""
    pixels = masks.numel()
    return lambda out: (
        nn.functional.cross_entropy(out, torch.zeros(out.shape[0], *out.shape[2:], dtype=torch.long), reduction="sum")
        / pixels
    )


def run_pipeline(
    comm: MPI.Comm,
    platform: Platform,
    m: int = 4,
    batch: int = 8,
    side: int = 64,
    width: int = 4,
    depth: int = 3,
    schedule: str = "1f1b",
    steps: int = 5,
    bounds: list[int] | None = None,
    rounds: int = 5,
) -> Validation:
    """lab 06's UNet stages, one per rank, run with lab 07's schedule on M micro-batches (M=1: lab 06).

    The stages are the oracle's balanced cut (from the profile) unless `bounds` are given.
    """
    from ..data.images import make_segmentation
    from ..model_parallel import Stage
    from ..models.unet import UNet
    from ..pipeline import gpipe, one_f_one_b, pipeline_step

    k = comm.Get_size()
    torch.manual_seed(0)
    unet = UNet(width=width, depth=depth)
    images, masks = make_segmentation(batch, side, seed=0)
    micro = batch // m
    shape = (3, side, side)
    info, platform = _profile(
        comm,
        lambda: (copy.deepcopy(unet), images[:micro].clone(), _unet_loss(masks[:micro])),
        "UNet",
        shape,
        platform,
        rounds=rounds,
    )
    crossings = Crossings(unet, shape, batch=1)
    prediction = pipeline(info, batch, k, m, platform, schedule=schedule, edges=unet_edges(crossings), bounds=bounds)
    bounds = [int(b) for b in prediction.notes.split("bounds ")[1].strip("[]").split(", ")]
    ledger = Ledger(stage=f"stage {comm.Get_rank()}")
    stage = Stage(unet, bounds, comm, shape, ledger=ledger)
    optimizer = _sgd(stage.parameters())
    ledger.watch(stage.layers, optimizer)
    order = one_f_one_b if schedule == "1f1b" else gpipe
    seconds = timed_steps(comm, lambda: pipeline_step(stage, order, images, masks, m, optimizer), steps)
    ledger.close()
    stage.mailbox.free()
    report = {**ledger.report(), "buffers": 0}
    return Validation(prediction, seconds, comm.allgather(report), list(range(k)))


# Lab 08: spatial, filter, data x spatial -----------------------------------------------------------
def _unet_setup(batch: int, side: int, width: int, depth: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    from ..data.images import make_segmentation
    from ..models.unet import UNet

    torch.manual_seed(0)
    images, masks = make_segmentation(batch, side, seed=0)
    return UNet(width=width, depth=depth), images, masks


def _ledger_report(ledger: Ledger) -> dict[str, int]:
    """The ledger's report with buffers 0: what an implementation keeps for its exchanges is among its activations."""
    return {**ledger.report(), "buffers": 0}


def _stubbed_step(net: nn.Module, x: torch.Tensor, target: torch.Tensor) -> Callable[[], None]:
    """A training step of net (an implementation over stand-in messages) on x, for `overhead_per_exchange`."""
    optimizer = _sgd(net.parameters())

    def step() -> None:
        nn.functional.cross_entropy(net(x), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step


def _implementation(
    comm: MPI.Comm,
    platform: Platform,
    name: str,
    stubbed: Callable[[], None],
    first: Prediction,
    exchanges: int,
    samples: int,
    curves: Callable[[float], dict[str, Curve]],
    ranks: int,
) -> Platform:
    """platform with what an implementation adds, measured before its run (see `implementation`).

    overheads[name]: its step over stand-in messages against first.compute, per exchange
    and sample; then the curves of its exchanges on `ranks` ranks, `curves(gap)` measuring
    them with the step's compute per exchange (`gap` seconds) between calls.
    """
    overhead = overhead_per_exchange(comm, stubbed, first.compute, exchanges * samples)
    gap = (first.compute + overhead * exchanges * samples) / max(exchanges, 1)
    table = Curves(dict(platform.curves.table))
    for op, (sizes, seconds) in curves(gap).items():
        table.add(op, ranks, sizes, seconds)
    return replace(platform, curves=table, overheads={**platform.overheads, name: overhead})


def run_spatial(
    comm: MPI.Comm,
    platform: Platform,
    data_ways: int = 1,
    batch: int = 4,
    side: int = 64,
    width: int = 4,
    depth: int = 3,
    steps: int = 5,
    rounds: int = 5,
) -> Validation:
    """lab 08's SpatialUNet: slabs of rows over P / D ranks, D groups of samples (D > 1: data x spatial).

    The ledger's activations include the halo strips lab 08's convolution keeps (the
    prediction's buffers, `halo_rows_padded`), so measured buffers are 0 and the
    comparison is of totals. Before the run: the implementation's overhead per exchange
    (its step over `LocalHalo`) and its halo exchange's curve at the sizes the run sends.
    """
    from ..data_parallel import average_gradients
    from ..intra_layer import SpatialUNet, group_samples, make_grid
    from .strategies import halo_bytes, halo_exchanges, halo_layers, halo_rows_padded, spatial

    unet, images, masks = _unet_setup(batch, side, width, depth)
    p = comm.Get_size()
    s = p // data_ways
    grid = make_grid(comm, data_ways) if data_ways > 1 else None
    scomm = grid.spatial if grid else comm
    samples = group_samples(batch, grid) if grid else slice(0, batch)
    group = batch // data_ways
    net = SpatialUNet(unet, scomm, side)
    rows = net.rows
    slab = images[samples][:, :, rows].contiguous()
    target = masks[samples][:, rows].contiguous()
    slab_rows = side // s
    info, platform = _profile(
        comm,
        lambda: (
            copy.deepcopy(unet),
            images[:group, :, :slab_rows].contiguous(),
            _unet_loss(masks[:group, :slab_rows].contiguous()),
        ),
        "UNet",
        (3, side, side),
        platform,
        s,
        rounds,
    )
    first = spatial(info, batch, s, platform, halo_rows=halo_rows_padded, data_ways=data_ways)
    # LocalComm stands in for the slab group: it has the collectives a step calls, moving no data
    local = SpatialUNet(unet, cast(Comm, LocalComm(scomm.Get_rank(), s)), side, exchange=LocalHalo)
    sizes = [halo_bytes(layer, layer.halo) * group for layer in halo_layers(info, s)]
    platform = _implementation(
        comm,
        platform,
        "halo",
        _stubbed_step(local, slab, target),
        first,
        halo_exchanges(info, s),
        group,
        lambda gap: {"halo": halo_curve(scomm, [min(sizes), max(sizes)], gap)},
        s,
    )
    prediction = spatial(info, batch, s, platform, halo_rows=halo_rows_padded, data_ways=data_ways)
    optimizer = _sgd(net.model.parameters())
    ledger = Ledger(stage=f"rank {comm.Get_rank()}")
    ledger.watch(net.model, optimizer)

    def step() -> None:
        with ledger.activations():
            logits = net(slab)
            value = nn.functional.cross_entropy(logits, target, reduction="sum") * (s / (group * side * side))
        value.backward()
        average_gradients(net.model, scomm)
        if grid:
            average_gradients(net.model, grid.data)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    seconds = timed_steps(comm, step, steps)
    ledger.close()
    if grid:
        grid.free()
    kinds = [0 if r % s in (0, s - 1) else min(1, len(prediction.memory) - 1) for r in range(p)]
    return Validation(prediction, seconds, comm.allgather(_ledger_report(ledger)), kinds)


def run_filter(
    comm: MPI.Comm,
    platform: Platform,
    batch: int = 4,
    side: int = 64,
    width: int = 8,
    depth: int = 3,
    steps: int = 5,
    rounds: int = 5,
) -> Validation:
    """lab 08's FilterUNet: every 3x3 convolution's output channels split over the ranks.

    Before the run, as for spatial: the implementation's overhead per collective (its step
    over `LocalComm`) and its two collectives' curves at the sizes the run sends.
    """
    from ..intra_layer import FilterUNet
    from .strategies import channel_exchanges, filter_parallel, split_layers

    unet, images, masks = _unet_setup(batch, side, width, depth)
    p = comm.Get_size()
    info, platform = _profile(
        comm, lambda: (copy.deepcopy(unet), images, _unet_loss(masks)), "UNet", (3, side, side), platform, rounds=rounds
    )
    first = filter_parallel(info, batch, p, platform)
    # LocalComm stands in for the ranks: it has the collectives a step calls, moving no data
    local = FilterUNet(unet, cast(Comm, LocalComm(comm.Get_rank(), p)))
    split = [layer for layer, cut in zip(info.layers, split_layers(info, p)) if cut]
    outputs, inputs = [layer.output_bytes * batch for layer in split], [layer.input_bytes * batch for layer in split]
    platform = _implementation(
        comm,
        platform,
        "filter",
        _stubbed_step(local, images, masks),
        first,
        channel_exchanges(info, p),
        batch,
        lambda gap: filter_curves(comm, [min(outputs), max(outputs)], [min(inputs), max(inputs)], gap),
        p,
    )
    prediction = filter_parallel(info, batch, p, platform)
    net = FilterUNet(unet, comm)
    optimizer = _sgd(net.parameters())
    ledger = Ledger(stage=f"rank {comm.Get_rank()}")
    ledger.watch(net, optimizer)

    def step() -> None:
        with ledger.activations():
            value = nn.functional.cross_entropy(net(images), masks)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    seconds = timed_steps(comm, step, steps)
    ledger.close()
    return Validation(prediction, seconds, comm.allgather(_ledger_report(ledger)), [0] * p)


#: The runs of `run_all`: (name, function, keyword arguments); small sizes, a few seconds each.
RUNS: tuple[tuple[str, Callable[..., Validation], dict[str, Any]], ...] = (
    ("data", run_data, {}),
    ("layer (M=1)", run_pipeline, {"m": 1}),
    ("pipeline (M=4)", run_pipeline, {"m": 4}),
    ("spatial", run_spatial, {}),
    ("filter", run_filter, {}),
    ("data x spatial", run_spatial, {"data_ways": 2}),
)


def run_all(comm: MPI.Comm, platform: Platform, steps: int = 5, scale: int = 1, rounds: int = 5) -> list[Validation]:
    """Every run of RUNS on comm (4 ranks expected), `scale` times the default batch. A collective.

    `rounds`: of the profile's alternating alone / all-at-once timing (`_profile`)."""
    results = []
    for _, fn, kwargs in RUNS:
        extra = {
            "batch": kwargs.get("batch", {"run_data": 256}.get(fn.__name__, 8 if fn is run_pipeline else 4)) * scale
        }
        results.append(fn(comm, platform, steps=steps, rounds=rounds, **kwargs, **extra))
    return results
