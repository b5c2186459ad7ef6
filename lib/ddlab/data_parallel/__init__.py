"""Data parallelism from scratch (lab 04): one model replica per rank, gradients averaged.

- `broadcast_parameters`, `average_gradients`: the two operations that keep replicas equal.
- `DataParallel`: gradient buckets (25 MB cap, as PyTorch DDP) whose allreduces start
  from autograd hooks and overlap the rest of backward; `no_sync()` for accumulation.
- `train`, `evaluate`: the training loop (sharded data, timed phases, progress bar).
- `save_checkpoint`, `load_checkpoint`: rank 0 writes, all ranks resume.
- `init_gloo`, `torch_ddp`: PyTorch's DistributedDataParallel on the same ranks.

Any allreduce with lab 03's signature plugs in: `DataParallel(model, comm, allreduce=my_ring)`.
"""

from .buckets import DEFAULT_CAP_MB, Bucket, make_buckets, plan_buckets
from .checkpoint import load_checkpoint, save_checkpoint
from .sync import average_gradients, broadcast_parameters, replicas_differ, resolve_allreduce
from .torch_ddp import close_gloo, init_gloo, torch_ddp
from .training import PHASES, History, evaluate, progress_bar, squared_error, threads_per_rank, train
from .wrapper import DataParallel
