"""Context parallelism (lab 15): attention over a sequence split across ranks, by ring attention.

- blockwise.py: the online softmax: a partial result (out, max, sum) per block of keys, the exact
  merge of two, the finish, and the backward of one block from the log-sum-exp.
- layout.py: which positions each rank holds: contiguous or zig-zag (balanced under the causal
  mask), padded to a multiple of 2P; the work each rank does with either.
- ring.py: ring attention forward and backward with Isend/Irecv overlapped with compute, as
  an autograd function, and on a rank's heads of zig-zag rows (`ring_attention_heads`, lab 16's mesh).
- ulysses.py: the other split, DeepSpeed-Ulysses: an all-to-all turns the sequence split into a
  head split before attention and back after it.
- figures.py: the blocks moving round the ring, and the two layouts under the causal mask.
"""

from .blockwise import (
    Partial,
    attend_block,
    attend_block_backward,
    blockwise_attention,
    empty_partial,
    finish,
    merge_partials,
    reference_attention,
)
from .layout import (
    all_positions,
    causal_pairs,
    causal_work,
    contiguous_positions,
    padded_length,
    put_rows,
    take_rows,
    visible,
    zigzag_positions,
)
from .ring import (
    Ring,
    RingAttention,
    ring_attention,
    ring_attention_backward,
    ring_attention_heads,
    ring_attention_torch,
)
from .ulysses import heads_to_ranks, ranks_to_heads, ulysses_attention

__all__ = [
    "Partial",
    "Ring",
    "RingAttention",
    "all_positions",
    "attend_block",
    "attend_block_backward",
    "blockwise_attention",
    "causal_pairs",
    "causal_work",
    "contiguous_positions",
    "empty_partial",
    "finish",
    "heads_to_ranks",
    "merge_partials",
    "padded_length",
    "put_rows",
    "ranks_to_heads",
    "reference_attention",
    "ring_attention",
    "ring_attention_backward",
    "ring_attention_heads",
    "ring_attention_torch",
    "take_rows",
    "ulysses_attention",
    "visible",
    "zigzag_positions",
]
