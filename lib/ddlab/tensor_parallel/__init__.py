"""Tensor and sequence parallelism for a transformer (lab 14), Megatron-style, on lab 14's GPT.

- `allreduce`, `reduce_scatter`, `allgather`: on tensors, from the ring's two halves (lab 03).
- `Copy` (f), `Reduce` (g): the conjugate pair around a split MLP or attention; `Gather`,
  `ReduceScatter`: sequence parallelism's pair.
- `column_parallel_linear`, `row_parallel_linear`, `ColumnParallelLinear`, `RowParallelLinear`,
  `GatherLinear`: a linear layer split by output or input features.
- `ParallelAttention` (by heads), `ParallelMLP`, `ParallelBlock`.
- `VocabParallelEmbedding`, `vocab_parallel_cross_entropy`: the vocabulary split, logits never gathered.
- `TensorParallelGPT`, `reduce_sequence_parallel_grads`, `make_data_tensor_grid`, `train_step`.
- `activation_bytes_per_layer`, `bytes_sent_per_step`: Korthikanti et al.'s activation formulas, the bytes sent.

Every function takes its communicator explicitly. Exercise signatures are in the docstrings
of `conjugates` (14.1), `layers` (14.2), `block` (14.3), `vocab` (14.4).
"""

from .block import ParallelAttention, ParallelBlock, ParallelMLP, head_range, qkv_rows
from .collectives import allgather, allreduce, reduce_scatter
from .conjugates import Copy, Gather, Reduce, ReduceScatter
from .formulas import activation_bytes_per_layer, bytes_sent_per_step, ring_bytes
from .layers import ColumnParallelLinear, GatherLinear, RowParallelLinear, column_parallel_linear, row_parallel_linear
from .model import DataTensorGrid, TensorParallelGPT, make_data_tensor_grid, reduce_sequence_parallel_grads, train_step
from .vocab import VocabParallelCrossEntropy, VocabParallelEmbedding, vocab_parallel_cross_entropy, vocab_range
