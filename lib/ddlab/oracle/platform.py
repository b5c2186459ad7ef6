"""A platform as the oracle sees it: devices, compute rate, memory, and what communication costs.

Communication is empirical first: measured time curves of each collective over message
size, per rank count, interpolated log-log in the size (`Curves`). Where no curve was
measured (another rank count, a size far outside), the one cost model of links and
collectives (`ddlab.allreduce.cost.collective_seconds`) prices the bandwidth-optimal
algorithms MPI libraries use for large messages over the link (recursive halving and
doubling; Thakur, Rabenseifner & Gropp, IJHPCA 2005), with L = ceil(log2 P) steps:

    allreduce       2 L alpha + 2 (P-1)/P n beta
    allgather       L alpha + (P-1)/P n beta       (n: bytes of the whole result)
    reduce_scatter  L alpha + (P-1)/P n beta       (n: bytes of the whole input)
    p2p             alpha + n beta
    alltoall        (P-1) alpha + (P-1)/P n beta   (pairwise; n: bytes a rank sends to all)

A collective whose ranks all sit in one node uses the intra-node link, one that spans
nodes the inter-node link (the slowest edge of the ring sets its pace). `sharing` is how
many such collectives share one node's network link at once (hybrid strategies).

An all-to-all has no ring: each rank sends its pieces to every other rank at once, each
on its own path, so across nodes the pieces for the ranks of its own node ride the
intra-node link while the others cross the network, and the slower of the two sets the
time. With k_max ranks in the fullest node and k_min in the emptiest (the groups tiling
the machine from rank 0), and each rank its own network adapter (as on DGX nodes; a node
whose ranks share an adapter states it with `sharing`), the P-1 start-ups at the
network's alpha:

    alltoall across nodes   (P-1) alpha + max((k_max-1)/P n beta_intra, (P-k_min)/P n beta_inter)

`contention[n-1]` is how much slower a device computes while n devices of a node
compute at once (1 on a GPU; on a CPU the cores and memory bandwidth are shared; not
ParaDL's contention, which is the network's and corresponds to `sharing` here), and
`sync` what each blocking exchange costs beyond its message time when the ranks that
must meet share cores with each other and other programs (a partner that is not
running must first be scheduled; 0 with a core or device per rank): both measured by
`ddlab.oracle.measure`. `curves` may also hold an implementation's own exchange (lab 08's
"halo", "filter allgather", ...) timed while every rank computes, and `overheads[name]`
the seconds per exchange and sample that implementation spends beyond the layers'
compute (slicing, padding, copies, small extra kernels): 0 where not measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..allreduce.cost import Link, collective_seconds

#: The collectives the oracle measures and prices (`ddlab.allreduce.cost.COLLECTIVES` has their formulas).
OPS = ("allreduce", "allgather", "reduce_scatter", "p2p", "alltoall")


@dataclass
class Curves:
    """Measured seconds of each collective: `table[(op, ranks)] = (sizes in bytes, seconds)`."""

    table: dict[tuple[str, int], tuple[list[float], list[float]]] = field(default_factory=dict)

    def add(self, op: str, ranks: int, sizes: list[float], seconds: list[float]) -> None:
        order = np.argsort(sizes)  # times at least 1 ns: the interpolation is log-log
        self.table[(op, ranks)] = ([float(sizes[i]) for i in order], [max(float(seconds[i]), 1e-9) for i in order])

    def seconds(self, op: str, nbytes: float, ranks: int) -> float | None:
        """Interpolated (log-log) time, linear extrapolation by bandwidth above the largest size; None if unmeasured."""
        entry = self.table.get((op, ranks))
        if entry is None or nbytes <= 0:
            return None if entry is None else 0.0
        sizes, times = np.asarray(entry[0]), np.asarray(entry[1])
        if nbytes <= sizes[0]:
            return float(times[0])
        if nbytes >= sizes[-1]:
            return float(times[-1] * nbytes / sizes[-1])
        return float(np.exp(np.interp(np.log(nbytes), np.log(sizes), np.log(times))))


#: A measured attention kernel: rows of (sequence length, forward FLOP/s, backward FLOP/s), lengths increasing.
AttentionRows = tuple[tuple[int, float, float], ...]


@dataclass
class Platform:
    """Devices, their compute rate (FLOP/s, achieved on training), memory, links, curves, contention."""

    name: str
    devices_per_node: int
    flops: float
    memory: int
    intra: Link
    inter: Link
    curves: Curves = field(default_factory=Curves)
    contention: tuple[float, ...] = (1.0,)
    sync: float = 0.0  # seconds a blocking exchange loses while ranks compute on shared cores
    overheads: dict[str, float] = field(default_factory=dict)  # an implementation's own work per exchange and sample
    sources: dict[str, str] = field(default_factory=dict)
    crossings: int = 1  # times each of `sharing` flows crosses the node's shared path to the network
    rates: dict[str, float] = field(default_factory=dict)  # achieved FLOP/s by number format ("fp8"); else `flops`
    # measured attention kernels: (kernel, head size) -> rows of (sequence length, forward FLOP/s, backward FLOP/s),
    # the sequence lengths increasing; `attention_rates`
    attention: dict[tuple[str, int], AttentionRows] = field(default_factory=dict)

    def link(self, ranks: int) -> Link:
        return self.intra if ranks <= self.devices_per_node else self.inter

    def comm(self, op: str, nbytes: float, ranks: int, stride: int = 1, sharing: int = 1) -> float:
        """Seconds of one collective of nbytes over `ranks` ranks (measured curve, else alpha-beta).

        The ranks sit `stride` apart (a data group of a hybrid); the collective crosses
        nodes if they span more than a node, and then `sharing` flows share each node's
        link, each crossing it `crossings` times (ParaDL counts 2 on ABCI: a GPU reaches
        the adapter through the PCIe switch its traffic leaves by). For p2p, `ranks` is 2,
        or the span between the two ranks.
        """
        if ranks <= 1 and op != "p2p":
            return 0.0
        measured = self.curves.seconds(op, nbytes, ranks) if stride == 1 else None
        if measured is not None:
            return measured
        if op not in OPS:
            raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(OPS)}")
        if op != "p2p" and nbytes <= 0:
            return 0.0
        link = self.link(ranks * stride)
        if sharing > 1 and ranks * stride > self.devices_per_node:
            link = replace(link, beta=link.beta * sharing * self.crossings)
        if op == "alltoall" and ranks * stride > self.devices_per_node:
            fullest = max(1, self.devices_per_node // stride)  # the collective's ranks in its fullest node
            emptiest = max(1, math.gcd(ranks * stride, self.devices_per_node) // stride)  # and in its emptiest
            return (ranks - 1) * link.alpha + max(
                (fullest - 1) / ranks * nbytes * self.intra.beta, (ranks - emptiest) / ranks * nbytes * link.beta
            )
        return float(collective_seconds(op, ranks, nbytes, link))

    def rate(self, compute: str) -> float:
        """Achieved FLOP/s of a device's matrix multiplications in number format `compute` ("bf16", "fp8", ...):
        `rates[compute]`, else `flops` (the 16-bit rate, or the only one measured)."""
        return self.rates.get(compute, self.flops)

    def attention_rates(self, kernel: str, head_dim: int, seq: int) -> tuple[float, float] | None:
        """(forward, backward) FLOP/s of attention kernel `kernel` with heads `head_dim` wide on queries of `seq`
        tokens, as measured (`attention`: interpolated in log sequence length, the nearest row outside the rows'
        range); None when none was measured for that kernel and head size."""
        rows = self.attention.get((kernel, head_dim))
        if not rows:
            return None
        lengths = [row[0] for row in rows]
        if any(a >= b for a, b in zip(lengths, lengths[1:])) or lengths[0] < 1:
            raise ValueError(f"{kernel} attention, heads {head_dim} wide: its sequence lengths must increase from 1 up")
        where = np.log(lengths)
        at = np.log(max(seq, 1))
        return (
            float(np.interp(at, where, [row[1] for row in rows])),
            float(np.interp(at, where, [row[2] for row in rows])),
        )

    def slowdown(self, busy: float) -> float:
        """Compute slowdown with `busy` devices of a node computing at once (fractions interpolate)."""
        busy = max(1.0, min(float(busy), self.devices_per_node, len(self.contention)))
        low = int(busy)
        high = min(low + 1, len(self.contention))
        return float(np.interp(busy, [low, high], [self.contention[low - 1], self.contention[high - 1]]))


def gpu_cluster() -> Platform:
    """ABCI-like nodes of 4 NVIDIA V100 SXM2 16 GB, NVLink 2 inside, 2 x InfiniBand EDR between.

    ABCI (AIST, Japan) is the machine ParaDL's oracle was validated on. Compute is what
    a V100 achieves training ResNet-50 in FP32, not its peak; latencies are typical
    MPI/NCCL start-up times on such links. Sources in `sources`.
    """
    resnet50_flops_per_image = 3 * 8.23e9  # forward + backward (2 x forward) of ResNet-50 at 224 x 224
    return Platform(
        name="V100 cluster (ABCI-like)",
        devices_per_node=4,
        flops=380 * resnet50_flops_per_image,  # 380 images/s: ~9.4 TFLOP/s of the 15.7 peak
        memory=16 * 10**9,
        intra=Link(alpha=10e-6, beta=1 / 50e9),
        inter=Link(alpha=10e-6, beta=1 / 25e9),
        contention=(1.0, 1.0, 1.0, 1.0),
        sources={
            "devices_per_node": "ABCI system overview (AIST): 4 NVIDIA Tesla V100 SXM2 per compute node",
            "memory": "NVIDIA Tesla V100 datasheet: 16 GB HBM2 (SXM2 16 GB as in ABCI)",
            "flops": (
                "NVIDIA V100 datasheet: 15.7 TFLOP/s FP32 peak; achieved on training taken as "
                "~380 images/s ResNet-50 FP32 on one V100 (NVIDIA Deep Learning Examples, "
                "ResNet-50 v1.5 training performance tables), times 24.7 GFLOP per image "
                "(forward 8.23 GFLOP traced here, backward twice that)"
            ),
            "intra": (
                "NVLink 2: 25 GB/s per link and direction (V100 datasheet: 6 links, 300 GB/s total); "
                "two links between each GPU pair of an ABCI node: 50 GB/s; alpha 10 us, "
                "a typical NCCL step latency (assumed, not sourced)"
            ),
            "inter": (
                "2 x InfiniBand EDR (100 Gb/s = 12.5 GB/s each) per ABCI node: 25 GB/s; alpha 10 us (assumed, as intra)"
            ),
            "contention": "one process per GPU: devices do not share compute (1.0)",
            "overheads": (
                "none: an implementation's own work per exchange (kernel launches, copies) is "
                "microseconds against layers of milliseconds on a V100; not measured here"
            ),
        },
    )
