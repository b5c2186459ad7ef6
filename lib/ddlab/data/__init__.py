"""Synthetic data sets made locally (no downloads), and sharding them over ranks."""

from .curves import StressStrainCurves, physical_targets
from .images import make_segmentation
from .sharding import ShardedSampler, epoch_permutation, eval_shard, shard_indices
from .text import BatchSampler, TextCorpus, make_corpus
