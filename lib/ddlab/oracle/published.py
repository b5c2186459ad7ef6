"""The oracle at scale: NVIDIA A100 80 GB nodes from published figures, and Narayanan et al.'s Table 1.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (arXiv:2104.04473), Table 1: ten GPT models from 1.7 B parameters on
32 GPUs to 1008 B on 3072, sequence 2048, vocabulary 51,200, trained on Selene's DGX A100
nodes (8 A100 80 GB per node); their measured teraFLOP/s per GPU count the FLOPs of
96 B s l h^2 (1 + s/(6h) + V/(16 l h)), recomputation included, and all ran with activation
recomputation. The table gives t, p, the GPUs and the global batch of each row; d is
GPUs / (t p). It does not give the micro-batch size: `TABLE1` takes b = 1, an assumption
(in the oracle b changes only the bubble, through m = B/(d b), and the activation memory).

The platform (`a100_cluster`) takes only published hardware figures, each named in
`sources`, and one achieved-compute figure: the hardware FLOPs utilisation Korthikanti et
al. ("Reducing Activation Recomputation in Large Transformer Models", MLSys 2023) measured
for their 1-trillion-parameter GPT on A100s with data-parallel size 1, 57.0% of peak (their
paper, arXiv:2205.05198, as Megatron-LM's README quotes it: model FLOPs utilisation 56.3%,
hardware 57.0%). Nothing is fitted to the rows of Table 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..allreduce.cost import Link
from .platform import Platform
from .transformer import GPT, Layout, TransformerPrediction, predict

A100_PEAK = 312e12  # FLOP/s, dense BF16/FP16 on the tensor cores (NVIDIA A100 datasheet)
ACHIEVED = 0.570  # Korthikanti et al., MLSys 2023: hardware FLOPs utilisation of the 1 T GPT, data-parallel size 1
ALPHA = 5e-6  # seconds per message: assumed, not a hardware figure (with 0, accuracies move by < 0.03)


@dataclass(frozen=True)
class PublishedRun:
    """One row of Narayanan et al.'s Table 1: the model, its layout, the measured teraFLOP/s per GPU."""

    gpt: GPT
    layout: Layout
    measured_tflops: float  # per GPU


def _row(
    billions: float, heads: int, hidden: int, layers: int, t: int, p: int, gpus: int, batch: int, tflops: float, v: int
):
    gpt = GPT(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200, name=f"GPT {billions:g} B")
    layout = Layout(
        data=gpus // (t * p), tensor=t, pipeline=p, batch=batch, micro_batch=1, recompute="full", interleave=v
    )
    return PublishedRun(gpt, layout, tflops)


#: Table 1 of Narayanan et al. (SC 2021): parameters (billions), heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU;
#: and v, the model chunks per pipeline rank of the interleaved schedule, which the table does not print: the layers
#: per stage over `--num-layers-per-virtual-pipeline-stage` in the scripts that produced the table (NVIDIA
#: Megatron-LM repository, examples/sc21/run_table_1.sh: 5 of 15 for 76 B, 5 of 10 for 145.6 B, 3 of 6 for 310.1 B,
#: 1 of 3 for 529.6 B; not set, plain 1F1B, for the others).
TABLE1 = (
    _row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 1),
    _row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 1),
    _row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 1),
    _row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 1),
    _row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 1),
    _row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 3),
    _row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2),
    _row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 2),
    _row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 3),
    _row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1),
)


def a100_cluster(achieved: float = ACHIEVED) -> Platform:
    """DGX A100 80 GB nodes: 8 GPUs on NVLink 3 / NVSwitch, 8 HDR InfiniBand adapters (one per GPU)."""
    return Platform(
        name="DGX A100 80 GB cluster (Selene-like)",
        devices_per_node=8,
        flops=achieved * A100_PEAK,
        memory=80 * 10**9,
        intra=Link(alpha=ALPHA, beta=1 / 300e9),
        inter=Link(alpha=ALPHA, beta=1 / 25e9),
        contention=(1.0,) * 8,
        sources={
            "devices_per_node": "NVIDIA DGX A100 datasheet: 8 A100 80 GB GPUs per system (Selene's nodes)",
            "flops": (
                "NVIDIA A100 datasheet: 312 TFLOP/s BF16/FP16 tensor-core peak (dense); times 57.0%, the hardware "
                "FLOPs utilisation Korthikanti et al. (MLSys 2023) measured for a 1 T GPT on A100s"
            ),
            "memory": "NVIDIA A100 80 GB datasheet: 80 GB HBM2e",
            "intra": (
                "NVIDIA A100 datasheet: NVLink 3, 600 GB/s per GPU both directions together (300 GB/s each way), "
                "every pair through NVSwitch (DGX A100 datasheet); alpha 5 us assumed"
            ),
            "inter": (
                "DGX A100 datasheet: 8 single-port ConnectX-6 HDR InfiniBand, 200 Gb/s = 25 GB/s each, one per "
                "GPU: a GPU's inter-node traffic has its own adapter; alpha 5 us assumed"
            ),
            "contention": "one process per GPU (1.0)",
        },
    )


def accuracy(predicted: float, measured: float) -> float:
    """1 - |predicted - measured| / measured (ParaDL's accuracy, Kahira et al., HPDC 2021)."""
    return 1 - abs(predicted - measured) / measured


def reproduce(platform: Platform | None = None) -> list[tuple[PublishedRun, TransformerPrediction, float]]:
    """(row, prediction of its published layout, accuracy of the predicted TFLOP/s per GPU) for each row."""
    platform = platform or a100_cluster()
    out = []
    for run in TABLE1:
        pred = predict(run.gpt, run.layout, platform)
        out.append((run, pred, accuracy(pred.model_flops_per_device() / 1e12, run.measured_tflops)))
    return out
