"""Checks for lab 10 (parameter servers): the stale-synchronous gate, the asynchronous worker, a gossip step.

`check_ssp_gate` first compares the student's gate with the rule on clock tables
(on every rank, so a stub fails everywhere), then plugs it into a real server on
every sub-communicator of two ranks or more, with a straggler, and reads the
recorded clocks: no worker released more than s steps ahead of the slowest, no
deadlock, every gradient applied exactly once.

`check_async_worker` runs the student's worker loop on ranks 1..P-1 against the
library's asynchronous server on rank 0, all through a CountingComm (timeouts, no
hang), on 2 ranks up to all. It proves exactly-once updates (each worker's step t
applied once), that each gradient was computed at the parameters the server sent
for that step and pushed as computed, with the version it was computed at, and a
clean end: every worker returns, no message is left unreceived.

`check_gossip_step` runs the student's step through a CountingComm and compares
with the average of each rank's parameters and its left neighbour's, the input
left unchanged, and exactly one message of the parameters' bytes to the right
(on one rank: none, or one to itself).
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..parameter_server import Consistency, LeastSquares, may_start, train
from ..parameter_server.server import Server
from ..runtime.comm import Comm
from ..runtime.counting import CountingComm
from ..runtime.waiting import PeerFailed
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
                    return (
                        f"clocks {clocks.tolist()} (steps finished), bound s = {bound}: a worker asking to "
                        f"start step {step} was {verdict}; how far ahead of the slowest would it be?"
                    )
    return None


def check_ssp_gate(gate: Callable[[np.ndarray, int, float], bool]) -> None:
    """Exercise 10.1: gate(clocks, step, bound) -> may a worker start step? On tables, then on a real server."""
    comm = MPI.COMM_WORLD
    fail_together(comm, _table_problem(gate), "check_ssp_gate on clock tables")
    problem = LeastSquares(n=6, samples=64, batch=4)

    def body(sub: MPI.Comm) -> str | None:
        for bound in (0, 2):
            record = train(sub, f"ssp{bound}", problem, STEPS, gate=gate, compute=0.002, straggler=3.0, timeout=10.0)
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


Worker = Callable[[Comm, int, Callable[[np.ndarray, int], np.ndarray], int], None]
STUB = "stub: "


class _RecordingServer(Server):
    """The asynchronous server, remembering what it sent each worker and what it applied."""

    def __init__(self, comm: CountingComm, params: np.ndarray, workers: list[int]):
        super().__init__(comm, params, workers, STEPS, 0.05, Consistency.parse("async"), comm.watch)
        self.sent: dict[int, list[tuple[int, np.ndarray]]] = defaultdict(list)  # worker -> (version, params)
        self.got: dict[tuple[int, int], tuple[int, np.ndarray]] = {}  # (worker, step) -> (version, gradient)

    def send_parameters(self, worker: int, go: bool) -> None:
        if go:
            self.sent[worker].append((self.version, self.params.copy()))
        super().send_parameters(worker, go)

    def apply(self, worker: int, step: int, version: int, grad: np.ndarray) -> None:
        self.got[worker, step] = (version, grad.copy())
        super().apply(worker, step, version, grad)


def _leftover(sub: MPI.Comm) -> list[tuple[int, int]]:
    """(source, tag) of every message still unreceived on sub, received now so none lingers."""
    found, status, until = [], MPI.Status(), time.monotonic() + 0.05
    while time.monotonic() < until:
        if sub.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            found.append((status.Get_source(), status.Get_tag()))
            sub.Recv(np.empty(status.Get_count(MPI.BYTE), np.uint8), status.Get_source(), status.Get_tag())
    return found


def _worker_problem(
    server: _RecordingServer | None, calls: list[tuple[int, np.ndarray, np.ndarray]], sub: MPI.Comm, steps: int
) -> str | None:
    """Compare what this worker's gradient was called with (and returned) with what the server sent and applied."""
    rank = sub.Get_rank()
    sent, got, applied = sub.bcast((server.sent, server.got, server.log.applied) if server else None)
    if rank == 0:
        return None
    if [step for step, _, _ in calls] != list(range(steps)):
        return (
            f"called gradient for steps {[step for step, _, _ in calls]}, expected {list(range(steps))} "
            "(once per step, in order)"
        )
    wrong = [t for (t, params, _), (_, want) in zip(calls, sent[rank]) if not np.array_equal(params, want)]
    if len(sent[rank]) != steps or wrong:
        return (
            f"computed the gradient of step {wrong[0] if wrong else len(sent[rank])} at parameters other than "
            "the ones the server sent for that step: receive fresh parameters before every step"
        )
    counts = Counter({step: applied[rank, step] for step in range(steps)})
    if any(count != 1 for count in counts.values()):
        return f"the server applied steps {sorted(counts.items())} (step, times): each step's gradient once"
    for (step, _, grad), (version, _) in zip(calls, sent[rank]):
        pushed_version, pushed = got[rank, step]
        if not np.array_equal(pushed, grad):
            return f"pushed a gradient for step {step} that is not what gradient(params, {step}) returned"
        if pushed_version != version:
            return f"pushed step {step} as computed at version {pushed_version}, but it pulled version {version}"
    return None


def check_async_worker(async_worker: Worker) -> None:
    """Exercise 10.2: async_worker(comm, n, gradient, steps) against an asynchronous server on rank 0."""
    comm = MPI.COMM_WORLD
    problem = LeastSquares(n=5, samples=64, batch=4)

    def roles(counting: CountingComm) -> _RecordingServer | None:
        """Rank 0 serves, the others run the student's loop; a stub stops the server at once."""
        rank, size = counting.Get_rank(), counting.Get_size()
        if rank == 0:
            server = _RecordingServer(counting, problem.start(), list(range(1, size)))
            try:
                server.serve()
            except PeerFailed as err:
                if STUB in str(err):
                    raise NotImplementedError(str(err).split(STUB, 1)[1].rstrip(")")) from None
                raise
            if server.log.problem:
                raise RuntimeError(f"the server on rank 0 stopped: {server.log.problem}")
            return server

        def gradient(params: np.ndarray, step: int) -> np.ndarray:
            grad = problem.gradient(params, rank, step)
            calls.append((step, np.array(params, dtype=float), grad.copy()))
            return grad

        try:
            async_worker(counting, problem.n, gradient, STEPS)
        except NotImplementedError as err:
            counting.fail_all(f"{STUB}{err}")
            raise
        return None

    def body(sub: MPI.Comm) -> str | None:
        calls.clear()
        server, _ = run_counted(sub, roles, (), "async_worker", timeout=5.0)
        leftover = _leftover(sub)
        problem = _worker_problem(server, calls, sub, STEPS)  # a collective: every rank calls it
        if leftover:
            return (
                f"messages (source, tag) {leftover} were never received: every parameter message the server "
                "sends must be received, every gradient sent once"
            )
        return problem

    calls: list[tuple[int, np.ndarray, np.ndarray]] = []
    each_size(comm, body, "check_async_worker", sizes=range(2, comm.Get_size() + 1))
    passed(comm, "every step pulled, computed at the parameters pulled, pushed once; the loop ends cleanly")


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
            return (
                f"sent {[(e.peer, e.nbytes) for e in sends]} (rank, bytes), expected {want}: "
                "one message with the parameters to the right neighbour"
            )
        return None

    each_size(comm, body, "check_gossip_step")
    passed(comm, "one gossip step averages with the left neighbour, one message per rank")


__all__ = ["CheckFailed", "check_async_worker", "check_gossip_step", "check_ssp_gate"]
