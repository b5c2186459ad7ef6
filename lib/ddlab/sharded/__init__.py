"""Sharded data parallelism (lab 13): ZeRO stages 1-3 / FSDP built from a reduce-scatter and an allgather.

- `FlatSpace` (flat.py): a unit's parameters in one padded flat buffer, P equal shards, views.
- `Sharded` (zero.py): ZeRO-1, ZeRO-2, ZeRO-3 with prefetch, mixed precision and activation checkpointing.
- `ShardedOptimizer` (optimizer.py): ZeRO-1 around any element-wise torch.optim class, its state for one shard.
- `DynamicLossScale` (precision.py): float16 training without gradients underflowing.
- `save_sharded`, `load_sharded` (checkpoint.py): each rank writes its shards; load on any rank count.
- `to_dcp`, `from_dcp` (torch_checkpoint.py): a checkpoint to and from torch.distributed.checkpoint (FSDP2 reads it).
- `torch_zero`, `torch_fsdp`, `held_bytes` (torch_baselines.py): torch's ZeroRedundancyOptimizer and FSDP2 beside
  ddlab's, and the bytes of model state a rank holds, counted alike for all.
- `HybridSharded` (hybrid.py): HSDP, sharded inside groups of ranks and replicated across them.
- collectives.py: the pluggable reduce-scatter and allgather ("mpi", "ring" = lab 03's halves, yours).
"""

from .checkpoint import CheckpointError, load_sharded, save_sharded
from .collectives import CHOICES, allgather_mpi, reduce_scatter_mpi, resolve_collectives
from .flat import FlatSpace
from .hybrid import HybridSharded, two_stage
from .optimizer import ShardedOptimizer
from .precision import DynamicLossScale
from .torch_baselines import held_bytes, torch_fsdp, torch_zero
from .torch_checkpoint import from_dcp, to_dcp
from .zero import STAGES, Sharded, Unit
