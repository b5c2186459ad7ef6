"""The two messages of the protocol, both float64 arrays: a header, then a slice of the parameters.

Worker -> server (tag GRADIENT): [worker, step, version the gradient was computed at, more] + gradient slice;
more = 0 on the worker's last gradient. Server -> worker (tag PARAMETERS): [version, go] + parameter
slice; go = 0 tells the worker to stop (a synchronous step that can never complete).
"""

from __future__ import annotations

import numpy as np

GRADIENT, PARAMETERS = 101, 102
GRADIENT_HEADER, PARAMETERS_HEADER = 4, 2


def shard_bounds(n: int, servers: int) -> list[tuple[int, int]]:
    """The [start, stop) slice of n parameters each of `servers` server ranks owns."""
    if not 1 <= servers:
        raise ValueError(f"need at least one server, got {servers}")
    edges = np.linspace(0, n, servers + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]
