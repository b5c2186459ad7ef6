"""The oracle (lab 09): predict time and memory per iteration of every strategy before running it.

After ParaDL (Kahira, Nguyen et al., "An Oracle for Guiding Large-Scale Model/Hybrid
Parallel Training of Convolutional Neural Networks", HPDC 2021).

- `describe`, `profile_seconds`, `ModelInfo`, `LayerInfo`: a torch model traced layer by layer.
- `Platform`, `Curves`, `gpu_cluster`: devices, compute, memory, measured collectives (links are
  `ddlab.allreduce.cost.Link`s).
- `measure_platform`: this machine's platform, in about a minute (a collective over comm).
- `data`, `spatial`, `pipeline`, `filter_parallel`, `channel_parallel` (with `data_ways` for
  the hybrids): `Prediction`s of time (compute, communication, bubble) and memory per rank.
- `plan`, `Plan`: the feasible strategies for P devices ranked by time, and why the others are not.
- `formulas`: the closed forms of lab 09's exercises (signatures in its docstring).
"""

from .describe import LayerInfo, ModelInfo, describe, profile_seconds
from .formulas import (
    data_parallel_memory,
    data_parallel_time,
    hybrid_time,
    neighbours,
    ring_allreduce_seconds,
    spatial_memory,
    spatial_time,
)
from .measure import measure_platform
from .planner import Plan, candidates, plan
from .platform import OPS, Curves, Platform, gpu_cluster
from .published import TABLE1, PublishedRun, a100_cluster, reproduce
from .strategies import (
    MEMORY,
    Prediction,
    boundary_edges,
    channel_parallel,
    data,
    filter_parallel,
    halo_rows_minimal,
    halo_rows_padded,
    pipeline,
    spatial,
    unet_edges,
)
from .transformer import GPT, Layout, TransformerPrediction, iteration_flops, memory_per_rank, predict_step, step_time
from .transformer_planner import TransformerPlan, explain, meshes, plan_transformer, search
