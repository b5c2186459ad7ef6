"""Communicating less (lab 11): compressed gradients and topology-aware allreduce.

- `compressors`: top-k, random-k, 8-bit stochastic quantization, 1-bit signs; error feedback.
- `sparse`: the sparse allreduce through Allgatherv and its cost against the dense ring.
- `allreducers`: `CompressedAllreduce`, any of them as lab 04's pluggable allreduce.
- `hierarchical`: the two-level allreduce over node groups (on lab 03's ring halves), its cost
  (priced with `ddlab.allreduce.cost`), an emulated slow link.
"""

from .allreducers import METHODS, CompressedAllreduce
from .compressors import (
    ErrorFeedback,
    Quantized,
    Signs,
    Sparse,
    densify,
    dequantize_8bit,
    keep_count,
    quantize_8bit,
    random_k,
    sign_1bit,
    top_k,
    top_k_with_feedback,
    unsign_1bit,
)
from .hierarchical import (
    GIGABIT_ETHERNET,
    SHARED_MEMORY,
    SlowLinkComm,
    emulated,
    flat_ring_seconds,
    held_blocks,
    hierarchical_allreduce,
    hierarchical_seconds,
    node_of,
)
from .sparse import (
    bandwidth_crossover_density,
    crossover_density,
    dense_ring_bytes_per_rank,
    sparse_allreduce,
    sparse_bytes_per_rank,
    sparse_seconds,
)
