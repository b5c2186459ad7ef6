"""Tensor and sequence parallelism for a transformer (lab 14), Megatron-style, on lab 14's GPT.

- `allreduce`, `reduce_scatter`, `allgather`: on tensors, from the ring's two halves (lab 03).
- `Copy` (f), `Reduce` (g): the conjugate pair around a split MLP or attention; `Gather`,
  `ReduceScatter`: sequence parallelism's pair; `Scatter`: whole replicated tensors cut to sequence blocks.
- `column_parallel_linear`, `row_parallel_linear`, `ColumnParallelLinear`, `RowParallelLinear`,
  `GatherLinear`: a linear layer split by output or input features.
- `ParallelAttention` (by heads), `ParallelMLP`, `ParallelBlock`; `parallel_attention` and
  `sequence_parallel_block` (with `BlockParts`), the functional forms exercises 14.3 and 14.5 write.
- `parallelize(block, comm, plan)`, `parallelize_gpt`, `PLAN`: the module surgery of exercise 14.3 (the idea of
  PyTorch's `parallelize_module`), one process's block made tensor parallel by replacing its layers; with a
  sequence-parallel block forward (exercise 14.5's), `SequenceParallelBlocks` runs the split blocks by it; with a
  vocabulary-parallel loss (exercise 14.4's), `VocabParallelGPT` splits the embedding and the loss too.
- `VocabParallelEmbedding`, `vocab_parallel_cross_entropy`: the vocabulary split, logits never gathered.
- `TensorParallelGPT`, `reduce_sequence_parallel_grads`, `make_data_tensor_grid`, `train_step`; `Samples`
  and `residual_part`: which part of the whole tensor a rank's dropout masks keep (samples, sequence rows).
- `figures.plot_split_block`: the split block, which tensor is split and where each collective sits.
- `activation_bytes_per_layer`, `bytes_sent_per_step`: Korthikanti et al.'s activation formulas, the bytes sent.

Every function takes its communicator explicitly. Exercise signatures are in the docstrings
of `conjugates` (14.1), `layers` (14.2), `surgery` (14.3), `vocab` (14.4), `layers.GatherLinear` and
`block` (14.5).
"""

from .block import (
    BlockParts,
    ParallelAttention,
    ParallelBlock,
    ParallelMLP,
    Samples,
    head_range,
    heads_attention,
    parallel_attention,
    qkv_rows,
    residual_part,
    sequence_parallel_block,
)
from .collectives import allgather, allreduce, reduce_scatter
from .conjugates import Copy, Gather, Reduce, ReduceScatter, Scatter
from .formulas import activation_bytes_per_layer, bytes_sent_per_step, ring_bytes
from .layers import ColumnParallelLinear, GatherLinear, RowParallelLinear, column_parallel_linear, row_parallel_linear
from .model import DataTensorGrid, TensorParallelGPT, make_data_tensor_grid, reduce_sequence_parallel_grads, train_step
from .surgery import PLAN, SequenceParallelBlocks, VocabParallelGPT, parallelize, parallelize_gpt
from .vocab import VocabParallelCrossEntropy, VocabParallelEmbedding, vocab_parallel_cross_entropy, vocab_range
