"""How long reading one epoch takes per strategy, as ranks grow: a bandwidth model (lab 12).

Each of P ranks trains on n/P samples of s bytes per epoch.

- global: every epoch all n s bytes come from the shared file system, whose aggregate
  bandwidth B_fs is split between the ranks, and no rank reads faster than its node's
  link b_link: t = (n s / P) / min(B_fs / P, b_link) = n s / min(B_fs, P b_link).
  Past P = B_fs / b_link the time stops falling: the file system is the bottleneck.
- local: (n s / P) / b_local, from each node's own disk; falls as 1/P.
- partial (Q): local, plus sending Q of the samples over the network (a fraction
  (P-1)/P of them to other ranks) at b_net per rank: + Q (n s / P)(P-1)/P / b_net.

Against a compute time per epoch of t_1 / P (perfect scaling), global shuffling costs
more than the training itself once n s / B_fs > t_1 / P: `affordable_ranks`.
Bandwidths in bytes per second. Staging (one copy from shared storage) is left out.
The global formula assumes every epoch reads the shared copy; a cache that reads it once
(NoPFS: Dryden et al., "Clairvoyant Prefetching for Distributed Machine Learning I/O",
SC 2021) leaves only the n s - P c bytes that do not fit in P node caches of c bytes.
"""

from __future__ import annotations

import numpy as np


def epoch_read_time(
    strategy: str,
    ranks: np.ndarray | int,
    nbytes: float,
    fs_bandwidth: float,
    link_bandwidth: float,
    local_bandwidth: float,
    net_bandwidth: float,
    q: float = 0.0,
) -> np.ndarray:
    """Seconds to get one epoch's samples to the ranks under `strategy` ("global", "local", "partial")."""
    p = np.asarray(ranks, dtype=float)
    per_rank = nbytes / p
    if strategy == "global":
        return per_rank / np.minimum(fs_bandwidth / p, link_bandwidth)
    local = per_rank / local_bandwidth
    if strategy == "local":
        return local
    if strategy == "partial":
        return local + q * per_rank * (p - 1) / p / net_bandwidth
    raise ValueError(f"strategy must be global, local or partial, got {strategy!r}")


def affordable_ranks(compute_epoch_one: float, nbytes: float, fs_bandwidth: float) -> float:
    """The rank count past which reading an epoch from shared storage takes longer than computing it.

    Reading takes at least n s / B_fs whatever P; computing takes t_1 / P.
    """
    return compute_epoch_one * fs_bandwidth / nbytes
