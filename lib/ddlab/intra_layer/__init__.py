"""Intra-layer parallelism (lab 08): split inside each layer, for images too large for one rank.

- `slab_bounds`: which rows each rank holds, whole through every pooling level.
- `HaloExchange` (`exchange_rows`): the rows a convolution needs from the neighbours, forward,
  and their gradients sent home, backward.
- `spatial_conv2d`, `padded_conv2d`, `SpatialUNet`, `spatial_step`: the lab's UNet on slabs of rows.
- `SpatialMaxPool` (`pool_halos`): max pooling whose window crosses the slab's edge (ResNet's stem
  pool): unequal halos, -inf at the image's edges.
- `FilterParallelConv`, `ChannelParallelConv` (`filter_slice`, `channel_slice`): a convolution
  split by output channels (allgather forward) or input channels (allreduce forward).
- `FilterUNet`, `filter_step`: the UNet with every 3x3 convolution filter parallel.
- `make_grid`, `Grid`, `hybrid_step`: data x spatial on a grid of sub-communicators.
- `try_strategy`, `intra_sweep`: which image sides train under a per-rank memory budget.
- `figures.plot_slabs`: the slabs and halos of an image (imported on its own: it needs matplotlib).

Every function takes its communicator explicitly. Exercise signatures are in the
docstrings of `halo` (8.1), `channels` (8.2), `slabs` (8.3) and `pooling` (8.4).
"""

from .channels import (
    ChannelParallelConv,
    FilterParallelConv,
    allgather_channels,
    allreduce_sum,
    channel_slice,
    filter_slice,
)
from .filter_unet import FilterConv, FilterUNet, filter_step
from .fit import COLUMNS, STRATEGIES, halo_share, intra_sweep, markdown_table, try_strategy
from .halo import HaloExchange, exchange_rows, wait_all
from .hybrid import Grid, group_samples, hybrid_step, make_grid
from .pooling import SpatialMaxPool, pool_halos
from .slabs import slab_bounds
from .spatial import SpatialUNet, conv_halo, padded_conv2d, slab_loss, spatial_conv2d, spatial_step
