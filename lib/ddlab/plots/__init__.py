"""Figures for the labs, by topic; every figure function is importable from here (ddlab.plots.NAME).

- `cluster`: the cluster a notebook drives (lab 00);
- `messages`: latency and bandwidth, data movement, allreduce patterns and sweeps (labs 01-03);
- `training`: the data set, scaling, time breakdowns, learning curves (labs 04-05);
- `model_parallel`: the split UNet, memory against image size, per-rank bars (lab 06);
- `timelines`: the one Gantt chart of spans per rank (labs 04-07) and the pipeline bubble.

New labs put their own figures in their package and reuse these (the Gantt chart, `_size_axis`).
"""

from ._helpers import _arrow, _box, _byte_label, _rank_colour, _size_axis
from .cluster import cluster_diagram
from .messages import (
                       allreduce_sweep,
                       bytes_against_lower_bound,
                       data_movement,
                       exchange_pattern,
                       latency_bandwidth,
                       ring_allreduce_steps,
                       time_vs_size,
)
from .model_parallel import memory_fit, per_layer_bars, rank_bars, unet_diagram
from .timelines import COLOURS, bubble_vs_theory, gantt, gantt_pair
from .training import (
                       batch_size_tradeoff,
                       fusion_costs,
                       learning_curves,
                       scaling_curves,
                       score_against_time,
                       stress_strain_curves,
                       time_breakdown,
)

__all__ = [
    "COLOURS", "allreduce_sweep", "batch_size_tradeoff", "bubble_vs_theory", "bytes_against_lower_bound",
    "cluster_diagram", "data_movement", "exchange_pattern", "fusion_costs", "gantt", "gantt_pair",
    "latency_bandwidth", "learning_curves", "memory_fit", "per_layer_bars", "rank_bars", "ring_allreduce_steps",
    "scaling_curves", "score_against_time", "stress_strain_curves", "time_breakdown", "time_vs_size", "unet_diagram",
    "_arrow", "_box", "_byte_label", "_rank_colour", "_size_axis",
]
