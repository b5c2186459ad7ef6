"""PyTorch's own DistributedDataParallel on the same MPI ranks, for comparison.

torch.distributed needs a rendezvous: every process must know the world size, its
rank, and an address where rank 0 listens. MPI already knows the first two; rank 0
picks a free port on the loopback address and broadcasts it. The gloo backend
(CPU tensors, TCP) then runs its own allreduce, in background threads, beside MPI.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .buckets import DEFAULT_CAP_MB

ADDRESS = "127.0.0.1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((ADDRESS, 0))
        return sock.getsockname()[1]


def init_gloo(comm: MPI.Comm, timeout: float = 60.0) -> None:
    """Start torch.distributed (gloo) with MPI's rank and size, on this machine's loopback.

    Does nothing if it is already running with the same rank and size (a rerun cell).
    All ranks must be on one machine; on a cluster, set MASTER_ADDR to rank 0's host.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) == (rank, size):
            return
        dist.destroy_process_group()
    port = comm.bcast(_free_port() if rank == 0 else None, root=0)
    os.environ["MASTER_ADDR"] = os.environ.get("DDLAB_MASTER_ADDR", ADDRESS)
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout))


def close_gloo() -> None:
    """Stop torch.distributed if it runs."""
    if dist.is_initialized():
        dist.destroy_process_group()


def torch_ddp(module: nn.Module, bucket_cap_mb: float = DEFAULT_CAP_MB) -> DistributedDataParallel:
    """Wrap `module` in torch's DDP (it broadcasts rank 0's parameters, as ddlab's does)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not running: call init_gloo(comm) first")
    return DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
