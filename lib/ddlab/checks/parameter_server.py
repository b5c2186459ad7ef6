"""Checks for lab 10 (parameter servers): the stale-synchronous gate, and one gossip averaging step.

`check_ssp_gate` first compares the student's gate with the rule on clock tables
(on every rank, so a stub fails everywhere), then plugs it into a real server on
every sub-communicator of two ranks or more, with a straggler, and reads the
recorded clocks: no worker released more than s steps ahead of the slowest, no
deadlock, every gradient applied exactly once.

`check_gossip_step` runs the student's step through a CountingComm and compares
with the average of each rank's parameters and its left neighbour's, the input
left unchanged, and exactly one message of the parameters' bytes to the right
(on one rank: none, or one to itself).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..parameter_server import LeastSquares, may_start, train
from ._core import array_problem, each_size, fail_together, passed, run_counted
from .errors import CheckFailed

BOUNDS = (0, 1, 2, 3, math.inf)
STEPS = 6


def _table_problem(gate: Callable[[np.ndarray, int, float], bool]) -> str | None:
    """The first clock table where the gate disagrees with the rule, described; or None."""
    rng = np.random.default_rng(10)
    for _ in range(40):
        clocks = rng.integers(0, 6, rng.integers(1, 5))
        for bound in BOUNDS:
            for step in range(int(clocks.min()), int(clocks.max()) + 5):
                got, want = gate(clocks.copy(), step, bound), may_start(clocks, step, bound)
                if not isinstance(got, (bool, np.bool_)):
                    return f"the gate should return a bool, got {type(got).__name__}"
                if bool(got) != want:
                    verdict = "let it start" if got else "made it wait"
                    return (f"clocks {clocks.tolist()} (steps finished), bound s = {bound}: a worker asking to "
                            f"start step {step} was {verdict}; how far ahead of the slowest would it be?")
    return None


def check_ssp_gate(gate: Callable[[np.ndarray, int, float], bool]) -> None:
    """Exercise 10.1: gate(clocks, step, bound) -> may a worker start step? On tables, then on a real server."""
    comm = MPI.COMM_WORLD
    fail_together(comm, _table_problem(gate), "check_ssp_gate on clock tables")
    problem = LeastSquares(n=6, samples=64, batch=4)

    def body(sub: MPI.Comm) -> str | None:
        for bound in (0, 2):
            record = train(sub, f"ssp{bound}", problem, STEPS, gate=gate, compute=0.002, straggler=3.0,
                           timeout=10.0)
            log = record.servers[0]
            if log.problem:
                return f"with s = {bound} the server stopped: {log.problem}"
            ahead = [(w, step, slow) for w, step, slow in log.releases if step - slow > bound]
            if ahead:
                w, step, slow = ahead[0]
                return f"with s = {bound}, rank {w} was let start step {step} while the slowest had finished {slow}"
            if any(count != 1 for count in log.applied.values()) or len(log.applied) != (sub.size - 1) * STEPS:
                return f"with s = {bound}, not every gradient was applied exactly once"
        return None

    each_size(comm, body, "check_ssp_gate on a real server", sizes=range(2, comm.Get_size() + 1))
    passed(comm, "the gate keeps every worker within s steps of the slowest, and never blocks for nothing")


def check_gossip_step(gossip_step: Callable[[MPI.Comm, np.ndarray], np.ndarray]) -> None:
    """Exercise 10.3: gossip_step(comm, params) -> mean of params and the left neighbour's, one message sent."""
    comm = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        params = np.random.default_rng([3, rank]).standard_normal(7)
        given = params.copy()
        result, traffic = run_counted(sub, gossip_step, (params,), "gossip_step")
        left = sub.allgather(given)[(rank - 1) % size]
        problem = array_problem(result, (given + left) / 2, "the result")
        if problem:
            return problem
        if not np.array_equal(params, given):
            return "changed its input params: return a new array and leave params as it was"
        if result is params or np.shares_memory(result, params):
            return "returned (a view of) its input params: return a new array"
        sends = traffic[rank].sends
        want = [((rank + 1) % size, params.nbytes)]
        if [(e.peer, e.nbytes) for e in sends] not in ([want, []] if size == 1 else [want]):
            return (f"sent {[(e.peer, e.nbytes) for e in sends]} (rank, bytes), expected {want}: "
                    "one message with the parameters to the right neighbour")
        return None

    each_size(comm, body, "check_gossip_step")
    passed(comm, "one gossip step averages with the left neighbour, one message per rank")


__all__ = ["CheckFailed", "check_gossip_step", "check_ssp_gate"]
