"""The device mesh (lab 16): named dimensions over sub-communicators, and lab 14's GPT trained on it.

- `DIMS`, `Mesh`, `split_mesh` (exercise 16.1's reference), `coordinates`, `validate_sizes`, `layouts`:
  P ranks as pipeline x data x context x tensor, each dimension's communicator made by Split.
- `Embeddings`, `Head`, `Chain`, `mesh_loss`, `sequence_rows`, `sum_sequence_parallel_grads`: the parts a
  stage is assembled from (exercise 16.2); `GPTStage`, `Chunks`, `MeshTrainer`, `train_on_mesh`, `MeshRun`,
  `context_rows`: a GPT's pipeline stage (or v chunks of the interleaved schedule) of tensor-parallel blocks (labs 07 and 14) whose attention is lab 15's ring attention over the
  context ranks (zig-zag rows), data parallelism or ZeRO (labs 04 and 13) over data x context.
- torch_mesh.py: the same mesh as torch's `init_device_mesh`, `BLOCK_PLACEMENTS` (Shard, Replicate,
  Partial for each tensor of a block) and `dtensor_block`, a block from DTensor-placed weights.
- figures.py: `plot_layouts`, each layout's step time and peak memory per rank.

Every function takes its communicator explicitly. Exercise 16.1's signature is in `layout`'s docstring.
"""

from .layout import DIMS, Mesh, coordinates, layouts, split_mesh, validate_sizes
from .training import (
    Chain,
    Chunks,
    Embeddings,
    GPTStage,
    Head,
    MeshRun,
    MeshTrainer,
    context_rows,
    mesh_loss,
    sequence_rows,
    sum_sequence_parallel_grads,
    train_on_mesh,
)
