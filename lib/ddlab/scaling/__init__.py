"""Lab 05, scaling: speedup and efficiency, where a step's time goes, batch and learning-rate scaling
(`experiments`), and runs at equal wall-clock time, MPI's allreduce against gloo's (`runs`)."""

from .experiments import (
    RULES,
    efficiency,
    fit_allreduce,
    fused_ratio,
    lr_factor,
    measure_training,
    speedup,
    time_pieces,
)
from .runs import AllreduceCounter, allreduce_vs_gloo, syncs_per_epoch, time_to_score, train_for_time
