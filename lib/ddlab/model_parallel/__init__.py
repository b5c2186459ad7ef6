"""Model parallelism (lab 06): a UNet cut into stages, one per rank, joined by messages autograd sees.

- `naive_split`, `balanced_split`, `StagePlan`: where to cut, and which tensors then cross.
- `profile_layers`: measured bytes and CPU seconds of every layer; `Crossings`: what a stage exchanges.
- `SendTensor`, `RecvTensor` (`send`, `recv`): point-to-point messages as autograd functions.
- `Mailbox`: non-blocking sends, receives with a timeout, clean recovery after a failure.
- `Stage`, `train_step`, `attempt`: one rank's stage; a training step; failing together.
- `Timeline`: per-rank timelines on the wall clock and on a busy (CPU-time) clock.
- `fit_sweep`, `fit_table`: which image sides train under a per-rank memory budget, per split.
- `u_split`, `PieceStage`: the U-shaped split, encoder and decoder level i on rank i, skips kept local.
- `compare_layouts`, `layout_table`: messages, skip bytes and peak memory per rank of layouts side by side.
"""

from .autograd import RecvTensor, SendTensor, recv, send
from .compare import StepTraffic, compare_layouts, layout_table, step_traffic
from .fit import SPLITS, Fit, first_error, fit_sweep, fit_table, largest_sides, memory_costs, try_split
from .messages import Mailbox
from .profile import LayerCost, profile_layers
from .splits import Crossings, Edge, StagePlan, balanced_split, check_bounds, naive_split, stage_costs, trace_shapes
from .stage import Stage, attempt, gradient_error, reference_gradients, train_step
from .timeline import Timeline, kind_totals, polite_barrier, utilisation
from .ushape import Piece, PiecePlan, PieceStage, layer_order_pieces, u_split
