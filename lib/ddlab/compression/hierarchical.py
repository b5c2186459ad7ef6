"""Topology-aware allreduce: reduce inside each node, across nodes on 1/g of the data, gather back.

Ranks come in groups of `group_size` consecutive ranks, each group standing for a node
(fast links inside, a slow link between). The vector is cut into g = group_size blocks
(`block_bounds`); in a group of s ranks (the last group may be smaller), local rank l
holds the contiguous blocks b with b * s // g == l. Then:

1. reduce-scatter inside the group: each rank gets its blocks summed over the group;
2. for each block, allreduce it across groups between the ranks holding it;
3. allgather inside the group: every rank gets every block.

Only step 2 crosses the slow link, and it carries 2(N-1)/N n/g items per rank (N
groups) instead of the flat ring's 2(P-1)/P n. But the g ranks of a node send theirs at
once, through the node's one network port: 2(N-1)/N n per node, close to what the flat
ring sends through it (one message of n/P per step, only one rank of a node sending out
of it), so the gain is latency (2(N-1) slow steps instead of 2(P-1)) and what the group
steps save, not g times fewer bytes. `hierarchical_seconds` and `SlowLinkComm` both price
one link per node, shared by its ranks. This is the
two-level scheme behind Horovod's hierarchical allreduce and, co-designed with the
network's topology, Nguyen & Wahib's halving-doubling allreduce ("An allreduce
algorithm and network co-design for large-scale training of distributed deep learning",
CCGrid 2021).

Exercise signature (lab 11):
`hierarchical_allreduce(comm, x, group_size)`: `x` a 1-D array, same length and dtype on
every rank; returns a new array of the elementwise sums; the three steps above over
sub-communicators made with `comm.Split`, moving data with the ring functions or
point-to-point messages on them (the check counts each step's bytes, so it refuses MPI's collectives).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from mpi4py import MPI

from ..allreduce import agree_on_input, allgather_ring, allreduce_ring, reduce_scatter_ring
from ..allreduce.cost import Link, collective_terms, terms
from ..runtime.blocks import block_bounds
from ..runtime.reference import reference


def node_of(rank: int, group_size: int) -> int:
    """The group (node) of a rank: consecutive ranks share one."""
    return rank // group_size


def held_blocks(local_rank: int, members: int, group_size: int) -> range:
    """The blocks (of group_size) a rank holds, local rank `local_rank` of a group of `members` ranks."""
    owners = [b * members // group_size for b in range(group_size)]
    mine = [b for b, owner in enumerate(owners) if owner == local_rank]
    return range(mine[0], mine[-1] + 1)


@reference("hierarchical_allreduce")
def hierarchical_allreduce(comm: MPI.Comm, x: np.ndarray, group_size: int) -> np.ndarray:
    """Two-level allreduce: ring reduce-scatter in each group, ring allreduce per block across, ring allgather."""
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    agree_on_input(comm, x)
    rank = comm.Get_rank()
    node = comm.Split(node_of(rank, group_size), rank)
    local, members = node.Get_rank(), node.Get_size()
    blocks = block_bounds(x.size, group_size)
    owned = [held_blocks(r, members, group_size) for r in range(members)]
    cuts = [blocks[held.start] for held in owned] + [x.size]
    # Every split before any data moves: a Split is a collective of all ranks, and one made
    # between two blocks' rings would hold the second block's holders until the first ring ends.
    holders = [comm.Split(0 if b in owned[local] else MPI.UNDEFINED, rank) for b in range(group_size)]
    part = reduce_scatter_ring(node, x, cuts)
    for b, across in enumerate(holders):
        if across != MPI.COMM_NULL:
            piece = slice(blocks[b] - cuts[local], blocks[b + 1] - cuts[local])
            part[piece] = allreduce_ring(across, part[piece])
            across.Free()
    out = allgather_ring(node, part, cuts)
    node.Free()
    return out


# The cost model ----------------------------------------------------------------------

#: Gigabit Ethernet between nodes, as measured on Ames Laboratory's IBM cluster: about
#: 800 Mbit/s (100 MB/s) from MPI and a latency of 110-130 µs.
#: Scalable Computing Laboratory, Ames Laboratory, "Selected benchmark results obtained on
#: the IBM cluster", http://www.scl.ameslab.gov/Projects/IBMCluster/Benchmarks.html
GIGABIT_ETHERNET = Link(alpha=120e-6, beta=1 / 100e6)


def flat_ring_seconds(
    nbytes: float | np.ndarray, size: int, group_size: int, intra: Link, inter: Link
) -> float | np.ndarray:
    """Predicted time of the flat ring over groups: 2(P-1) steps, each as slow as its slowest link.

    A step's messages move in parallel; once there are two groups, some message of every
    step crosses a group boundary, so every step costs the inter-node link's time.
    """
    return terms("ring", size, nbytes).seconds(inter if size > group_size else intra)


def hierarchical_seconds(
    nbytes: float | np.ndarray, size: int, group_size: int, intra: Link, inter: Link
) -> float | np.ndarray:
    """Predicted time of hierarchical_allreduce with full groups of g: a ring reduce-scatter and allgather
    of n inside each group, between them g ring allreduces of n/g across the groups at once.

    The g rings share each node's one link: every step, each sends n/(gN) bytes out of the
    node, n/N in all, so together they cost one ring allreduce of n across the N nodes.
    """
    g, nodes = min(group_size, size), -(-size // group_size)
    n = np.asarray(nbytes, dtype=float)
    inside = collective_terms("reduce_scatter", g, n, "ring") + collective_terms("allgather", g, n, "ring")
    return inside.seconds(intra) + terms("ring", nodes, n).seconds(inter)


# The emulated slow link ----------------------------------------------------------------


class NodePorts:
    """Each node's one network link, shared by its ranks: when it is next free, kept in an MPI window.

    `reserve(node, seconds)` books the node's link for `seconds` after whatever its ranks
    booked before (an exclusive lock on the slot, so concurrent senders queue) and returns
    when the booking ends, in time.monotonic() seconds: one clock for every rank of one
    machine, which is where an emulation runs. A collective of comm to create and to free.
    """

    def __init__(self, comm: MPI.Comm, group_size: int):
        self.group_size = group_size
        slot = 8 if comm.Get_rank() % group_size == 0 else 0
        self.win = MPI.Win.Allocate(slot, 8, comm=MPI.Intracomm(comm))

    def reserve(self, node: int, seconds: float) -> float:
        owner, slot = node * self.group_size, np.zeros(1)
        self.win.Lock(owner, MPI.LOCK_EXCLUSIVE)
        self.win.Get(slot, owner)
        self.win.Flush(owner)
        slot[0] = max(time.monotonic(), slot[0]) + seconds
        self.win.Put(slot, owner)
        self.win.Unlock(owner)
        return float(slot[0])

    def free(self) -> None:
        self.win.Free()


class SlowLinkComm:
    """A communicator whose messages between groups go through one slow link per group, as between nodes.

    Wraps an mpi4py communicator (`group_size` consecutive ranks of `world_ranks` form a
    node; a collective to create). Before a message leaves for a rank of another group, the
    sender books its node's link (`NodePorts`) for n beta after the bookings of the node's
    other ranks, and waits until that booking ends plus alpha (time.sleep): concurrent
    messages out of one node share its bandwidth, as through one network port, and the ring
    or the hierarchical allreduce built on Send/Recv/Sendrecv pays what it would pay on that
    network. `Split` gives wrapped sub-communicators that keep the world's groups and links.
    Anything else goes to the real communicator unchanged (the small shape agreement of lab
    03's allreduces among it). `Free()` on the wrapper made by the constructor frees the links.
    """

    def __init__(
        self,
        comm: MPI.Comm,
        group_size: int,
        link: Link,
        world_ranks: list[int] | None = None,
        ports: NodePorts | None = None,
    ):
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self.comm, self.group_size, self.link = comm, group_size, link
        self.world_ranks = world_ranks if world_ranks is not None else list(range(comm.Get_size()))
        self.owns_ports = ports is None
        self.ports = NodePorts(comm, group_size) if ports is None else ports
        self.delayed_bytes = 0

    def Get_rank(self) -> int:
        return self.comm.Get_rank()

    def Get_size(self) -> int:
        return self.comm.Get_size()

    def _delay(self, dest: int, buf: Any) -> None:
        me, them = self.world_ranks[self.comm.Get_rank()], self.world_ranks[dest]
        node = node_of(me, self.group_size)
        if node != node_of(them, self.group_size):
            nbytes = np.asarray(buf).nbytes
            self.delayed_bytes += nbytes
            sent = self.ports.reserve(node, nbytes * self.link.beta)
            time.sleep(max(0.0, sent + self.link.alpha - time.monotonic()))

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        self._delay(dest, buf)
        self.comm.Send(buf, dest, tag)

    def Sendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = MPI.ANY_SOURCE,
        recvtag: int = MPI.ANY_TAG,
    ) -> None:
        self._delay(dest, sendbuf)
        self.comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)

    def Split(self, color: int = 0, key: int = 0) -> Any:
        sub = self.comm.Split(color, key)
        if sub == MPI.COMM_NULL:
            return MPI.COMM_NULL
        members = sub.allgather(self.world_ranks[self.comm.Get_rank()])
        return SlowLinkComm(sub, self.group_size, self.link, members, self.ports)

    def Free(self) -> None:
        """A sub-communicator's wrapper frees it; the constructor's frees the links (not the comm it was given)."""
        if self.owns_ports:
            self.ports.free()
        else:
            self.comm.Free()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)


#: Shared memory between ranks of one machine, roughly (lab 01 measures yours): the models' intra-node link.
SHARED_MEMORY = Link(alpha=5e-6, beta=1 / 2e9)


def emulated(link: Link, base: Link = SHARED_MEMORY) -> Link:
    """The link a SlowLinkComm emulates: its delay on top of the real (shared-memory) transfer."""
    return Link(link.alpha + base.alpha, link.beta + base.beta)
