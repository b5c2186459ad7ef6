"""Time per iteration and peak memory per rank of every strategy, from a model and a platform.

The structure is ParaDL's (Kahira, Nguyen et al., "An Oracle for Guiding Large-Scale
Model/Hybrid Parallel Training of Convolutional Neural Networks", HPDC 2021): a step's time
is the compute each rank does (the layers' compute time for its share of the work, slowed
by contention when devices share cores: this library's term, not ParaDL's, whose contention
is the network's, here the `sharing` of a node's link), plus the communication the strategy needs (priced
by the platform's measured collectives), plus the pipeline bubble; memory per rank is the
ZeRO split (parameters, gradients, optimizer state) plus activations plus buffers and halos.

The strategies (P devices, batch B):

- data(P): each rank B/P samples of the whole model; allreduce of the gradients, in
  buckets of at most 25 MiB (lab 04); buffers: the flat bucket buffers (none with
  bucket_buffers=False: lab 04's, like DDP's gradient_as_bucket_view, hold the gradients).
- spatial(P): each rank a slab of H/P rows of every sample; a halo exchange per k x k
  convolution forward and backward, both neighbours at once as lab 08's exchange_rows
  does (one message time, not two); none backward for a first layer, whose input (the
  data) needs no gradient; allreduce of the gradients (lab 08).

Every blocking exchange also pays the platform's `sync` (0 on dedicated devices).
Where the platform holds a measured curve of the implementation's own exchange (lab
08's halo exchange "halo", its filter collectives "filter allgather" and "filter
allreduce", each timed while every rank computes: `ddlab.oracle.measure.exchange_curve`),
that curve prices each exchange instead of the MPI curve plus sync. The *overhead*
part is the implementation's own work beyond the layers' compute, per exchange and
sample (`platform.overheads`: the thin convolutions at a slab's edges, padding, copies
and Python of lab 08; measured, 0 where not measured).
- pipeline(K, M): stages of consecutive layers, M micro-batches; (M + K - 1) slots of
  the slowest stage, K - 1 of them the bubble; a stage keeps the activations of the
  micro-batches in flight: M under GPipe, min(K - s, M) under 1F1B (labs 06-07).
- filter(P), channel(P): the weights of every convolution and linear layer split by
  output (filter) or input (channel) channels; filter allgathers each output forward and
  allreduces the input's gradient backward; channel allreduces each output forward and
  allgathers the input's gradient backward. That prices a chain in which every split
  layer's input is whole on every rank (each rank cuts its channels out of it; the
  backward of that cut is the allgather); lab 08's ChannelParallelConv, whose input
  arrives already split, sends nothing backward. A first layer, whose input is the data,
  sends nothing backward under either split: no gradient of the data is needed.
  `split_compute=False` prices a framework whose split layers take as long as whole ones
  (ParaDL's runs: "the computation of a convolution layer barely changes with the increase
  in number of filters", technical report sec. VII-C).
- data x spatial (D x S), data x filter (D x F), data x pipeline (D x K): D groups,
  each running the second strategy on B/D samples, then an allreduce over the D groups
  of each rank's gradients. Groups are placed so the inner strategy stays inside a node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..model_parallel.splits import balanced_split
from .describe import LayerInfo, ModelInfo
from .formulas import neighbours
from .platform import Platform

MEMORY = ("parameters", "gradients", "optimizer", "activations", "buffers")
BUCKET_CAP = 25 * 2**20  # lab 04's DataParallel, as PyTorch DDP
SPLIT_KINDS = ("Conv2d", "Linear")  # what filter and channel parallelism split
Edges = Callable[[int, int], list[tuple[str, int, int]]]  # (kind, bytes per sample, layer using or making it)
HaloRows = Callable[[int, int], int]  # (halo rows k // 2, neighbours) -> halo rows a rank keeps


@dataclass(frozen=True)
class Prediction:
    """One strategy's predicted step: seconds by part, and bytes by part for each kind of rank."""

    strategy: str
    devices: int
    layout: dict[str, int]
    compute: float
    communication: float
    bubble: float
    memory: tuple[dict[str, float], ...]  # one entry per distinct rank (slab, stage, ...)
    notes: str = ""
    overhead: float = 0.0  # the implementation's own work per exchange (platform.overheads)

    @property
    def time(self) -> float:
        return self.compute + self.communication + self.bubble + self.overhead

    @property
    def peak(self) -> float:
        """Peak bytes of the rank that needs most."""
        return max(sum(m.values()) for m in self.memory)

    @property
    def peak_rank(self) -> dict[str, float]:
        return max(self.memory, key=lambda m: sum(m.values()))

    @property
    def label(self) -> str:
        return self.strategy + "(" + ", ".join(f"{k}={v}" for k, v in self.layout.items()) + ")"


def memory(
    parameters: float = 0, gradients: float = 0, optimizer: float = 0, activations: float = 0, buffers: float = 0
) -> dict[str, float]:
    return dict(zip(MEMORY, (parameters, gradients, optimizer, activations, buffers)))


def layer_seconds(layer: LayerInfo, platform: Platform) -> float:
    """Forward plus backward seconds of one sample: measured if profiled, else FLOPs at the platform's rate."""
    if layer.seconds_forward or layer.seconds_backward:
        return layer.seconds_forward + layer.seconds_backward
    return (layer.flops_forward + layer.flops_backward) / platform.flops


def compute_seconds(layers: Sequence[LayerInfo], samples: float, platform: Platform) -> float:
    return samples * sum(layer_seconds(layer, platform) for layer in layers)


def _update(model: ModelInfo, share: float) -> float:
    """The optimizer step on `share` of the parameters, as profiled (0 if not: negligible on a GPU)."""
    return model.update_seconds * share


def _state(params: float, copies: int) -> dict[str, float]:
    return memory(parameters=params, gradients=params, optimizer=copies * params)


def _buckets(nbytes: float, cap: float = BUCKET_CAP) -> list[float]:
    full, rest = divmod(nbytes, cap)
    return [cap] * int(full) + ([rest] if rest else [])


def _grad_allreduce(nbytes: float, ranks: int, platform: Platform, stride: int = 1, sharing: int = 1) -> float:
    if ranks <= 1:
        return 0.0
    return sum(platform.comm("allreduce", b, ranks, stride, sharing) + platform.sync for b in _buckets(nbytes))


def _exchange(platform: Platform, op: str, nbytes: float, ranks: int, fallback: float) -> float:
    """Seconds of one exchange: the implementation's measured curve `op` if the platform has one, else fallback."""
    measured = platform.curves.seconds(op, nbytes, ranks)
    return fallback if measured is None else measured


def sync_share(busy: float, platform: Platform) -> float:
    """The share of `platform.sync` an exchange pays while `busy` devices of a node compute at once, on average.

    sync was measured with every device computing; a partner answers late because
    computing ranks crowd it off the cores, so the share follows the contention:
    (c(busy) - 1) / (c(all) - 1), 0 with one rank busy; 1 where contention is flat.
    """
    full = platform.slowdown(platform.devices_per_node) - 1.0
    return 1.0 if full <= 0 else (platform.slowdown(busy) - 1.0) / full


def _busy(devices: int, platform: Platform) -> float:
    return platform.slowdown(min(devices, platform.devices_per_node))


# Data parallelism ------------------------------------------------------------------------
def data(
    model: ModelInfo,
    batch: int,
    p: int,
    platform: Platform,
    optimizer_copies: int = 1,
    bucket_buffers: bool = True,
    stride: int = 1,
    sharing: int = 1,
) -> Prediction:
    """B/P samples per rank, whole model everywhere, one allreduce of the gradients per bucket."""
    samples = batch / p
    w = model.parameter_bytes
    compute = (compute_seconds(model.layers, samples, platform) + _update(model, 1.0)) * _busy(p, platform)
    comm = _grad_allreduce(w, p, platform, stride, sharing) if p > 1 else 0.0
    mem = {
        **_state(w, optimizer_copies),
        "activations": model.activation_bytes * samples,
        "buffers": w if bucket_buffers else 0.0,
    }
    return Prediction("data", p, {"P": p}, compute, comm, 0.0, (mem,))


# Spatial parallelism ---------------------------------------------------------------------
def halo_rows_minimal(halo: int, sides: int) -> int:
    """A rank keeps the halo rows its neighbours sent: k // 2 from each."""
    return halo * sides


def halo_rows_padded(halo: int, sides: int) -> int:
    """What lab 08's spatial_conv2d keeps: two thin strips of 2 (k // 2) - 1 rows (the halo padded), at edges too."""
    return 2 * (2 * halo - 1)


def _spatial_layers(model: ModelInfo, s: int) -> list[bool]:
    """Which layers run on slabs (inputs with rows to cut), the others run whole on every rank."""
    return [len(layer.input_shape) == 3 and layer.input_shape[1] >= s for layer in model.layers]


def halo_layers(model: ModelInfo, s: int) -> list[LayerInfo]:
    """The layers that exchange halos on s slabs (each twice a step: rows forward, their gradient backward)."""
    return [layer for layer, cut in zip(model.layers, _spatial_layers(model, s)) if cut and layer.halo and s > 1]


def passes(model: ModelInfo, layer: LayerInfo) -> int:
    """Exchanges a split layer makes a step: forward and backward, forward only on the data (no gradient wanted)."""
    return 1 if layer is model.layers[0] else 2


def halo_exchanges(model: ModelInfo, s: int) -> int:
    """Halo exchanges of a step on s slabs: two per halo layer, one for a first layer."""
    return sum(passes(model, layer) for layer in halo_layers(model, s))


def halo_bytes(layer: LayerInfo, rows: int) -> float:
    channels, _, width = layer.input_shape
    return channels * rows * width * layer.itemsize


def spatial(
    model: ModelInfo,
    batch: int,
    s: int,
    platform: Platform,
    optimizer_copies: int = 1,
    halo_rows: HaloRows = halo_rows_minimal,
    data_ways: int = 1,
) -> Prediction:
    """Every sample cut into s slabs of rows; halos per k x k convolution; gradients allreduced.

    With data_ways D > 1 (data x spatial): D groups of s ranks on B/D samples each, then
    an allreduce over the D groups (ranks at stride s, sharing a node's link with the
    other slabs' allreduces).
    """
    samples = batch / data_ways
    sliced = _spatial_layers(model, s)
    work = sum(layer_seconds(layer, platform) * (1 / s if cut else 1.0) for layer, cut in zip(model.layers, sliced))
    p = s * data_ways
    compute = (work * samples + _update(model, 1.0)) * _busy(p, platform)
    halo, span = 0.0, min(s, platform.devices_per_node)
    for layer in halo_layers(model, s):
        nbytes = halo_bytes(layer, layer.halo) * samples  # to each neighbour, both at once
        fallback = platform.comm("p2p", nbytes, span) + platform.sync
        halo += passes(model, layer) * _exchange(platform, "halo", nbytes, s, fallback)
    w = model.parameter_bytes
    comm = halo + _grad_allreduce(w, s, platform)
    if data_ways > 1:
        comm += _grad_allreduce(w, data_ways, platform, stride=s, sharing=min(s, platform.devices_per_node))
    acts = sum(layer.activation_bytes * (1 / s if cut else 1.0) for layer, cut in zip(model.layers, sliced)) * samples
    ranks = []
    for rank in sorted({0, min(1, s - 1)}):  # an edge slab and (if any) an inner one
        sides = neighbours(rank, s)
        kept = sum(halo_bytes(layer, halo_rows(layer.halo, sides)) for layer in halo_layers(model, s)) * samples
        ranks.append({**_state(w, optimizer_copies), "activations": acts, "buffers": kept})
    name, layout = ("spatial", {"S": s}) if data_ways == 1 else ("data x spatial", {"D": data_ways, "S": s})
    overhead = halo_exchanges(model, s) * samples * platform.overheads.get("halo", 0.0)
    return Prediction(name, p, layout, compute, comm, 0.0, tuple(ranks), overhead=overhead)


# Filter and channel parallelism -----------------------------------------------------------
def split_layers(model: ModelInfo, ways: int) -> list[bool]:
    """Layers whose weights are split: convolutions and linear layers with at least `ways` channels to split."""
    out = []
    for layer in model.layers:
        channels = layer.output_shape[0] if layer.output_shape else 0
        out.append(layer.kind in SPLIT_KINDS and channels >= ways)
    return out


def channel_exchanges(model: ModelInfo, f: int) -> int:
    """Collectives a filter- or channel-parallel step calls: forward and backward per split layer (a first one: forward)."""
    if f <= 1:
        return 0
    return sum(passes(model, layer) for layer, cut in zip(model.layers, split_layers(model, f)) if cut)


def _channel_parallel(
    kind: str,
    model: ModelInfo,
    batch: int,
    f: int,
    platform: Platform,
    optimizer_copies: int,
    data_ways: int,
    split_compute: bool = True,
) -> Prediction:
    samples = batch / data_ways
    split = split_layers(model, f)
    share = [1 / f if cut else 1.0 for cut in split]
    p = f * data_ways
    work = sum(layer_seconds(layer, platform) * (s if split_compute else 1.0) for layer, s in zip(model.layers, share))
    w = sum(layer.parameter_bytes * s for layer, s in zip(model.layers, share))
    compute = (work * samples + _update(model, w / max(model.parameter_bytes, 1))) * _busy(p, platform)
    ops = ("allgather", "allreduce") if kind == "filter" else ("allreduce", "allgather")
    comm = 0.0
    acts = 0.0
    for layer, cut in zip(model.layers, split):
        if cut and f > 1:
            sent = zip(ops, (layer.output_bytes * samples, layer.input_bytes * samples))
            for op, nbytes in list(sent)[: passes(model, layer)]:
                comm += _exchange(platform, f"{kind} {op}", nbytes, f, platform.comm(op, nbytes, f) + platform.sync)
        # filter: every rank keeps whole inputs; channel: the split layers keep their input's channels
        acts += layer.activation_bytes * (1 / f if cut and kind == "channel" else 1.0) * samples
    if data_ways > 1:
        comm += _grad_allreduce(w, data_ways, platform, stride=f, sharing=min(f, platform.devices_per_node))
    name, layout = (kind, {"F": f}) if data_ways == 1 else (f"data x {kind}", {"D": data_ways, "F": f})
    mem = {**_state(w, optimizer_copies), "activations": acts, "buffers": 0.0}
    overhead = channel_exchanges(model, f) * samples * platform.overheads.get(kind, 0.0)
    return Prediction(name, p, layout, compute, comm, 0.0, (mem,), overhead=overhead)


def filter_parallel(
    model: ModelInfo,
    batch: int,
    f: int,
    platform: Platform,
    optimizer_copies: int = 1,
    data_ways: int = 1,
    split_compute: bool = True,
) -> Prediction:
    """Output channels split over f ranks: allgather forward, allreduce of the input's gradient backward."""
    return _channel_parallel("filter", model, batch, f, platform, optimizer_copies, data_ways, split_compute)


def channel_parallel(
    model: ModelInfo,
    batch: int,
    f: int,
    platform: Platform,
    optimizer_copies: int = 1,
    data_ways: int = 1,
    split_compute: bool = True,
) -> Prediction:
    """Input channels split over f ranks: allreduce of partial outputs forward, allgather of gradients backward."""
    return _channel_parallel("channel", model, batch, f, platform, optimizer_copies, data_ways, split_compute)


# Layer (pipeline) parallelism -----------------------------------------------------------
def boundary_edges(model: ModelInfo) -> Edges:
    """What a stage of layers a..b-1 receives ("in") and sends ("out") when only neighbouring layers talk."""

    def edges(a: int, b: int) -> list[tuple[str, int, int]]:
        found = [("in", model.layers[a - 1].output_bytes, a)] if a > 0 else []
        return found + ([("out", model.layers[b - 1].output_bytes, b - 1)] if b < len(model.layers) else [])

    return edges


def unet_edges(crossings: Any) -> Edges:
    """Edges of lab 06's UNet from its `Crossings` (built with batch=1): the activations and the skips."""

    def edges(a: int, b: int) -> list[tuple[str, int, int]]:
        found = [("in", crossings.activation[a - 1], a)] if a > 0 else []
        found += [("out", crossings.activation[b - 1], b - 1)] if b < crossings.n else []
        for src, dst, nbytes in crossings.skips:
            if (a <= src < b) != (a <= dst < b):
                found.append(("skip in", nbytes, dst) if a <= dst < b else ("skip out", nbytes, src))
        return found

    return edges


def pipeline(
    model: ModelInfo,
    batch: int,
    k: int,
    m: int,
    platform: Platform,
    optimizer_copies: int = 1,
    schedule: str = "1f1b",
    bounds: list[int] | None = None,
    edges: Edges | None = None,
    data_ways: int = 1,
) -> Prediction:
    """K stages (balanced by compute unless bounds are given), M micro-batches of B/(D M) samples.

    edges(a, b): what a stage holding layers a..b-1 receives and sends, per sample
    (default: the activations at its two ends; the UNet's skips too: `unet_edges`).
    Each message goes forward and its gradient back. A stage keeps, per micro-batch in
    flight, the activation it received if the layer before had already saved it (else
    its own first layer's count holds it). A received skip lives until the layer that
    concatenates it: the micro-batch in forward peaks either at its end or just before
    such a layer, with the skips still waiting. The step takes
    the sum of the stage slots plus M - 1 slots of the slowest stage; the bubble is
    what is left after the slowest stage's M slots. Contention: ranks are busy only
    outside the bubble, so on average K M / (M + K - 1) of them compute at once, and
    each message pays that share of the platform's sync (`sync_share`).
    """
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    n = len(model.layers)
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} layers into {k} stages")
    costs = [layer_seconds(layer, platform) for layer in model.layers]
    bounds = bounds or balanced_split(costs, k)
    edges = edges or boundary_edges(model)
    micro = batch / (data_ways * m)
    p = k * data_ways
    busy = min(k * m / (m + k - 1) * data_ways, platform.devices_per_node)
    slow, sync = platform.slowdown(busy), platform.sync * sync_share(busy, platform)
    stage_compute, stage_comm, ranks = [], [], []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        layers = model.layers[a:b]
        stage_compute.append(compute_seconds(layers, micro, platform) * slow)
        crossing = edges(a, b)
        stage_comm.append(
            sum(2 * (platform.comm("p2p", nbytes * micro, 2) + sync) for _, nbytes, _ in crossing) if k > 1 else 0.0
        )
        in_flight = m if schedule == "gpipe" else min(k - s, m)
        w = sum(layer.parameter_bytes for layer in layers)
        received = sum(nbytes for kind, nbytes, _ in crossing if kind == "in" and layers[0].input_saved_before)
        saved = received + sum(layer.activation_bytes for layer in layers)
        current = saved
        for kind, _, at in crossing:
            if kind == "skip in":
                waiting = sum(n for kind2, n, j in crossing if kind2 == "skip in" and j >= at)
                current = max(current, received + sum(layer.activation_bytes for layer in model.layers[a:at]) + waiting)
        acts = micro * ((in_flight - 1) * saved + current)
        ranks.append({**_state(w, optimizer_copies), "activations": acts, "buffers": 0.0})
    slots = [c + t for c, t in zip(stage_compute, stage_comm)]
    worst = max(range(k), key=lambda s: slots[s])
    share = max(sum(r["parameters"] for r in ranks[s : s + 1]) for s in range(k)) / max(model.parameter_bytes, 1)
    compute = m * stage_compute[worst] + _update(model, share) * slow
    comm = m * stage_comm[worst]
    if data_ways > 1:
        comm += _grad_allreduce(
            max(r["parameters"] for r in ranks),
            data_ways,
            platform,
            stride=k,
            sharing=min(k, platform.devices_per_node),
        )
    name = "pipeline" if data_ways == 1 else "data x pipeline"
    layout = {"K": k, "M": m} if data_ways == 1 else {"D": data_ways, "K": k, "M": m}
    bubble = sum(slots) - slots[worst]
    return Prediction(name, p, layout, compute, comm, bubble, tuple(ranks), notes=f"{schedule}, bounds {bounds}")
