"""What every lab stands on: the cluster of engines, the MPI launcher, the Comm protocol, the counting
communicator, the one wait with a deadline, per-rank traces, the memory ledger and block partitions."""
