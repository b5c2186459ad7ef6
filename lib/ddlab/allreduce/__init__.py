"""Lab 03, allreduce: the algorithms inside MPI and NCCL (`algorithms`), and what collectives cost (`cost`).

`cost` is the one cost model of links and collectives every lab's model prices with.
"""

from .algorithms import (
    ALGORITHMS,
    RING_TAG,
    TAG,
    Allreduce,
    agree_on_input,
    allgather_ring,
    allreduce_mpi,
    allreduce_naive,
    allreduce_rabenseifner,
    allreduce_recursive_doubling,
    allreduce_ring,
    allreduce_tree,
    fold_in,
    fold_out,
    largest_power_of_two,
    member_rank,
    reduce_scatter_ring,
)
