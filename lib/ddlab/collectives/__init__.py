"""Lab 02, collectives: broadcast and reduce built from point-to-point messages, linear and binomial tree."""

from .rooted import TAG, bcast_linear, bcast_mpi, bcast_tree, reduce_linear, reduce_mpi, reduce_tree
