"""Synthetic data sets made locally (no downloads), sharding over ranks, file-backed shards and shuffling."""

from .curves import StressStrainCurves, physical_targets
from .images import make_segmentation
from .sharding import ShardedSampler, epoch_permutation, eval_shard, shard_indices
from .shuffling import STRATEGIES, IOCounters, Shuffler, exchange_plan, exchange_samples, exchanged_count
from .storage import SampleFiles, remove_store, stage, write_shared
from .text import BatchSampler, TextCorpus, make_corpus
