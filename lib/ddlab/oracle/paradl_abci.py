"""The oracle against ParaDL's published runs: ResNet-50 and VGG-16 on 32 to 256 V100 GPUs of ABCI.

ParaDL's technical report (Kahira, Nguyen et al., "A Model-driven Analysis of the Practical
Limits of Large-scale DNN Training", Table VIII, paraDL-analysis repository) gives, for
data x spatial, data x filter, filter and channel parallelism, the measured seconds per
ImageNet epoch and ParaDL's own projection. `compare()` predicts the same runs with this
library's strategies (`ddlab.oracle.strategies`) on `abci(...)`, a platform built from
published inputs only, and returns one `Row` per run with each prediction's accuracy.
Nothing is fitted to the measured times: not per row, not per strategy.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from ..allreduce.cost import Link
from ..models.cnn import resnet50, vgg16
from .describe import ModelInfo, describe
from .platform import Curves, Platform
from .strategies import Prediction, channel_parallel, filter_parallel, spatial
from .validate import accuracy

DATA = Path(__file__).with_name("data") / "paradl_abci.csv"
EPOCH = 1_281_167  # ImageNet-1k training images; ParaDL rounds to 1.28 M
STRATEGIES = ("data x spatial", "data x filter", "filter", "channel")

#: Seconds of forward and backward per sample on one V100, as ParaDL profiled them (the per-sample
#: compute in the model files of the paraDL-analysis repository, model/*_profall.net_sc).
SECONDS_PER_SAMPLE = {"ResNet-50": 0.003119502, "VGG-16": 0.008245589}


@dataclass(frozen=True)
class Row:
    """One published run: measured and ParaDL's epoch seconds, and this library's prediction."""

    model: str
    gpus: int
    strategy: str
    batch: int
    measured: float
    paradl: float
    ddlab: float
    prediction: Prediction

    @property
    def paradl_accuracy(self) -> float:
        return accuracy(self.paradl, self.measured)

    @property
    def ddlab_accuracy(self) -> float:
        return accuracy(self.ddlab, self.measured)


def read_rows(path: Path = DATA) -> list[dict[str, str]]:
    """The published table, one dict per run (the file's comment lines skipped)."""
    with open(path, newline="") as handle:
        return list(csv.DictReader(line for line in handle if not line.startswith("#")))


#: ParaDL's figures for a transfer between GPUs staged through the host (no GPUDirect), as its
#: spatial implementation does: PCIe through the node's PLX switch, 16 GB/s, and 3 ms + 110 ns
#: start-up, measured (parallel_analysis.py in the paraDL-analysis repository).
STAGED = Link(alpha=3e-3 + 110e-9, beta=1 / 16e9)


def staged_halo(devices_per_node: int) -> tuple[list[float], list[float]]:
    """Seconds of one halo exchange of the implementation ParaDL measured, staged through the host.

    As ParaDL describes it, the exchange runs in two rounds, one per direction along the
    slabs (unlike lab 08's, which posts both at once); in each, every GPU of the node sends one
    message, and those `devices_per_node` messages share the node's PCIe switch:
    2 (alpha + devices n beta). Tabulated at every power of sqrt(2) from 1 B to 4 GiB, so that the
    curve's log-log interpolation stays within 0.5% of that (`test_staged_halo_curve_is_the_link`).
    """
    sizes = [2 ** (k / 2) for k in range(65)]
    return sizes, [2 * (STAGED.alpha + devices_per_node * n * STAGED.beta) for n in sizes]


def abci(info: ModelInfo) -> Platform:
    """ABCI's compute nodes as ParaDL describes them, with the compute rate of `info`'s profile.

    Every number is published; none is taken from the measured epochs. Sources in `sources`.
    """
    curves = Curves()
    curves.add("halo", 4, *staged_halo(4))
    return Platform(
        name="ABCI (ParaDL's inputs)",
        devices_per_node=4,
        flops=info.flops / SECONDS_PER_SAMPLE[info.name],
        memory=16 * 10**9,
        intra=Link(alpha=9e-6, beta=1 / 50e9),
        inter=Link(alpha=40.31e-6, beta=1 / 12.5e9),
        contention=(1.0, 1.0, 1.0, 1.0),
        curves=curves,
        crossings=2,
        sources={
            "flops": "the model's traced FLOPs over ParaDL's profiled seconds per sample on one V100",
            "intra": "NVLink 2 between the GPUs of a node: 50 GB/s, 9 us a hop (ParaDL's parallel_analysis.py)",
            "inter": "InfiniBand EDR: 12.5 GB/s a node (ABCI.plat); 40.31 us end to end through PCIe and switches",
            "crossings": "2: the flows of a node's GPUs cross its PCIe switch twice on the way out (ParaDL's model)",
            "halo": "staged through the host in two rounds, one per direction: 16 GB/s PCIe shared by the node's 4 "
            "flows of a round, 3 ms start-up (ParaDL's model of its spatial implementation)",
        },
    )


#: What ParaDL reports of the implementation its runs measured: a convolution's time "barely
#: changes with the increase in number of filters" a GPU computes (technical report, sec. VII-C).
CHAINERMN = {"split_compute": False}


def model_info(name: str) -> ModelInfo:
    """The model traced at 224 x 224 (ParaDL's files pad to 226: the same layers)."""
    build = {"ResNet-50": resnet50, "VGG-16": vgg16}[name]
    return describe(build(), (3, 224, 224), name)


def predict(info: ModelInfo, strategy: str, gpus: int, batch: int, platform: Platform) -> Prediction:
    """This library's prediction of one iteration; the hybrids keep the model-parallel part in a node."""
    inner = platform.devices_per_node
    if strategy == "data x spatial":
        return spatial(info, batch, inner, platform, data_ways=gpus // inner)
    if strategy == "data x filter":
        return filter_parallel(info, batch, inner, platform, data_ways=gpus // inner, **CHAINERMN)
    if strategy == "filter":
        return filter_parallel(info, batch, gpus, platform, **CHAINERMN)
    if strategy == "channel":
        return channel_parallel(info, batch, gpus, platform, **CHAINERMN)
    raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")


def compare(path: Path = DATA) -> list[Row]:
    """Every published run with ParaDL's projection and this library's, seconds per epoch."""
    rows, infos = [], {}
    for entry in read_rows(path):
        name = entry["model"]
        if name not in infos:
            infos[name] = model_info(name)
        info = infos[name]
        gpus, batch = int(entry["gpus"]), int(entry["batch"])
        prediction = predict(info, entry["strategy"], gpus, batch, abci(info))
        iterations = math.ceil(EPOCH / batch)
        rows.append(
            Row(
                name,
                gpus,
                entry["strategy"],
                batch,
                float(entry["measured_total"]),
                float(entry["paradl_total"]),
                prediction.time * iterations,
                prediction,
            )
        )
    return rows


def ranked_as_measured(rows: list[Row], key: str) -> dict[tuple[str, int], bool]:
    """Per model and GPU count: does the prediction `key` ("ddlab" or "paradl") order the strategies as measured?

    Ties in a prediction (ParaDL prices filter and channel alike) do not order them: False.
    """
    out = {}
    for group in sorted({(r.model, r.gpus) for r in rows}):
        chosen = [r for r in rows if (r.model, r.gpus) == group]
        measured = sorted(chosen, key=lambda r: r.measured)
        values = [getattr(r, key) for r in measured]
        out[group] = all(a < b for a, b in zip(values, values[1:]))
    return out
