"""Low precision across ranks (lab 18): loss scaling agreed by every rank, bfloat16 with float32 masters
in the sharded optimizer, float8 casts with scales, the float8 all-gather, a reduction's error against P.

- `LossScale`, `loss_scale_step` (scaling.py): dynamic loss scaling, one decision for all ranks
  (exercise 18.1); `train_float16`, `train_float16_one_process`: float16 data parallelism with it.
- `quantize_float8`, `dequantize`, `AmaxHistory`, `cast_error` (float8.py): float8 casts per tensor,
  from a delayed amax history, per block (exercise 18.2).
- `float8_allgather`, `bfloat16_allgather` (gather.py): ZeRO-3's gather in float8 with the scales (exercise 18.3).
- `reduce_scatter_rounded`, `reduction_bound`, `relative_error` (reduction.py): a ring reduce-scatter
  rounded to bfloat16 or float32 at every hop, against Higham's bound.
- `MixedShardedOptimizer`, `train_mixed`, `predicted_bytes_per_parameter` (mixed.py): bfloat16
  mixed precision with float32 masters in lab 13's ZeRO-1.
- `RECIPES`, `train_recipe` (recipes.py): the lab's GPT trained in float32, bfloat16, float16 (with and
  without loss scaling) and emulated float8 (per tensor, delayed, per block).
- `measured_bytes`, `predicted_bytes`, `PRECISIONS` (footprint.py): each recipe's bytes per parameter and per
  activation, counted by the ledger and predicted by the transformer oracle (the recipe as a `Precision`).
"""

from .float8 import FORMATS, AmaxHistory, block_amax, cast_error, dequantize, fmax, quantize_float8
from .footprint import PRECISIONS, measured_bytes, predicted_bytes
from .gather import bfloat16_allgather, float8_allgather
from .mixed import MixedShardedOptimizer, predicted_bytes_per_parameter, train_mixed
from .recipes import RECIPES, train_recipe
from .reduction import UNIT_ROUNDOFF, reduce_scatter_rounded, reduction_bound, relative_error
from .scaling import LossScale, loss_scale_step, train_float16, train_float16_one_process

__all__ = [
    "FORMATS",
    "PRECISIONS",
    "RECIPES",
    "AmaxHistory",
    "LossScale",
    "MixedShardedOptimizer",
    "UNIT_ROUNDOFF",
    "bfloat16_allgather",
    "block_amax",
    "cast_error",
    "dequantize",
    "float8_allgather",
    "fmax",
    "loss_scale_step",
    "measured_bytes",
    "predicted_bytes",
    "predicted_bytes_per_parameter",
    "quantize_float8",
    "reduce_scatter_rounded",
    "reduction_bound",
    "relative_error",
    "train_float16",
    "train_float16_one_process",
    "train_mixed",
    "train_recipe",
]
