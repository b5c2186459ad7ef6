"""PyTorch's own DistributedDataParallel on the same MPI ranks, for comparison.

torch.distributed needs a rendezvous: every process must know the world size, its
rank, and an address where rank 0 listens. MPI already knows the first two; rank 0
listens on a free port of the loopback address and broadcasts it. The gloo backend
(CPU tensors, TCP over loopback) then runs its own allreduce, in background threads, beside MPI.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..runtime.loopback import ADDRESS, interface
from .buckets import DEFAULT_CAP_MB


def init_gloo(comm: MPI.Comm, timeout: float = 60.0) -> None:
    """Start torch.distributed (gloo) with MPI's rank and size, on this machine's loopback.

    Does nothing if it is already running with the same rank and size (a rerun cell).
    All ranks must be on one machine: rank 0's rendezvous (torch's TCPStore) listens on a socket
    ddlab binds to loopback, and gloo's connections use the loopback interface ($GLOO_SOCKET_IFNAME
    wins), so nothing listens on the network. On a cluster, set DDLAB_MASTER_ADDR to rank 0's host:
    the rendezvous then listens where torch puts it (every interface).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) == (rank, size):
            return
        dist.destroy_process_group()
    wait = datetime.timedelta(seconds=timeout)
    if os.environ.get("DDLAB_MASTER_ADDR"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            free = sock.getsockname()[1]
        os.environ["MASTER_ADDR"] = os.environ["DDLAB_MASTER_ADDR"]
        os.environ["MASTER_PORT"] = str(comm.bcast(free if rank == 0 else None, root=0))
        dist.init_process_group("gloo", rank=rank, world_size=size, timeout=wait)
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface())
    listener = None
    if rank == 0:  # torch's own server would listen on every interface, whatever the address it is given
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((ADDRESS, 0))
        listener.listen()
    port = comm.bcast(listener.getsockname()[1] if listener else None, root=0)
    fd = listener.detach() if listener else None  # the store owns (and closes) the socket from here
    store = dist.TCPStore(ADDRESS, port, size, is_master=rank == 0, timeout=wait, master_listen_fd=fd)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=wait)


def close_gloo() -> None:
    """Stop torch.distributed if it runs."""
    if dist.is_initialized():
        dist.destroy_process_group()


def torch_ddp(module: nn.Module, bucket_cap_mb: float = DEFAULT_CAP_MB) -> DistributedDataParallel:
    """Wrap `module` in torch's DDP (it broadcasts rank 0's parameters, as ddlab's does)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not running: call init_gloo(comm) first")
    return DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
