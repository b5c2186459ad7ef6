"""A failure detector with a deadline: a dead peer (MPI says so) is not a slow one (nothing yet).

Exercise 19.1's signature: `detect(comm, source, timeout) -> str`, on a communicator whose errors
are returned (MPI.ERRORS_RETURN) in a job launched fault-tolerant (ULFM): wait for one message
from `source` (any tag, 8 float64 items at most) and return "arrived" when it did, "dead" as soon
as MPI reports `source` failed (MPI.ERR_PROC_FAILED from the pending receive), "slow" if neither
happened within `timeout` seconds (the receive is then cancelled, so nothing is left pending).
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..runtime.comm import Comm
from ..runtime.reference import reference

#: The MPI error classes that mean a peer died (or the communicator was revoked because one did).
FAILURE_CLASSES = frozenset({MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED})

#: Items the heartbeat buffer holds: detect accepts any message of at most this many float64.
HEARTBEAT_ITEMS = 8


def is_failure(err: BaseException) -> bool:
    """Whether `err` is MPI saying a peer died or the communicator was revoked (ULFM's errors).

    Not counted: MPI_ERR_OTHER, which Open MPI 5's `Barrier` returned on rank 0 (in 5 runs of 5, 4 ranks, one
    SIGKILLed) while the others got ERR_PROC_FAILED or ERR_REVOKED; it is also what unrelated faults give. Detect
    failures on point-to-point messages and reductions (`Allreduce` returned ERR_PROC_FAILED there), or revoke on
    any error of a fault-tolerant communicator and let `Agree` decide."""
    return isinstance(err, MPI.Exception) and err.Get_error_class() in FAILURE_CLASSES


@reference("detect")
def detect(comm: Comm, source: int, timeout: float) -> str:
    """'arrived', 'dead' or 'slow': what became of one message from `source` within `timeout` s."""
    buf = np.empty(HEARTBEAT_ITEMS)
    request = comm.Irecv(buf, source=source, tag=MPI.ANY_TAG)
    end = time.monotonic() + timeout
    pause = 1e-5
    while True:
        try:
            if request.Test():
                return "arrived"
        except MPI.Exception as err:
            if is_failure(err):
                return "dead"
            raise
        if time.monotonic() > end:
            request.Cancel()
            request.Wait()
            return "slow"
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
