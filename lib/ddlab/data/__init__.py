"""Synthetic data sets made locally (no downloads), and sharding over ranks."""

from .curves import StressStrainCurves, physical_targets
from .sharding import ShardedSampler, epoch_permutation, eval_shard, shard_indices
from .images import make_segmentation
