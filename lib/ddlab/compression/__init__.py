"""Communicating less (lab 11): compressed gradients and topology-aware allreduce.

- `compressors`: top-k, random-k, QSGD and 8-bit stochastic quantization, 1-bit signs; error feedback;
  the bias and error of a compressor measured over draws.
- `sparse`: the sparse allreduce through Allgatherv and its cost against the dense ring.
- `allreducers`: `CompressedAllreduce`, any of them as lab 04's pluggable allreduce.
- `hierarchical`: the two-level allreduce over node groups (on lab 03's ring halves), its cost
  (priced with `ddlab.allreduce.cost`), an emulated slow link: one per node, shared by its ranks.
"""

from .allreducers import METHODS, CompressedAllreduce
from .compressors import (
    ErrorFeedback,
    Quantized,
    Signs,
    Sparse,
    bias_and_error,
    densify,
    dequantize_8bit,
    keep_count,
    qsgd,
    quantize_8bit,
    random_k,
    sign_1bit,
    top_k,
    top_k_with_feedback,
    unqsgd,
    unsign_1bit,
)
from .hierarchical import (
    GIGABIT_ETHERNET,
    SHARED_MEMORY,
    NodePorts,
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
