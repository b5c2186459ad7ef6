"""A server rank: owns a slice of the parameters, applies workers' gradients under a consistency mode.

The server waits for one gradient at a time (a receive from any worker), applies it
(or, synchronously, the average once all of step t are in), then sends fresh
parameters to every waiting worker the gate lets start its next step. It records
everything the tests and figures need: which (worker, step) it applied, each
update's staleness, the gap between a released step and the slowest clock, and
snapshots of its slice over time. A worker that stops early is reported; in
synchronous mode the step it misses can never complete, so the server stops the
others and reports the gradients it could not apply. Lab 10's exercise 10.3 has the
student write this loop for one stale-synchronous server.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..runtime.comm import Comm
from ..runtime.reference import reference
from ..runtime.waiting import PeerFailed, Stalled, Watch
from .gate import Consistency, may_start
from .messages import GRADIENT, GRADIENT_HEADER, PARAMETERS

Gate = Callable[[np.ndarray, int, float], bool]  # may_start's signature


@dataclass
class ServerLog:
    """What one server did (clocks count the steps a worker has finished)."""

    applied: Counter[tuple[int, int]] = field(default_factory=Counter)  # (worker, step) -> times applied
    staleness: list[int] = field(default_factory=list)  # updates applied since the gradient's version
    releases: list[tuple[int, int, int]] = field(default_factory=list)  # (worker, step, slowest clock)
    snapshots: list[tuple[float, int, np.ndarray]] = field(default_factory=list)  # (seconds, version, slice)
    early: dict[int, int] = field(default_factory=dict)  # worker -> steps it finished, if fewer than planned
    dropped: list[tuple[int, int]] = field(default_factory=list)  # gradients received but never applied
    problem: str | None = None


@reference("ssp_server")
class Server:
    """One server's state: its slice, the workers' clocks, who waits for parameters."""

    def __init__(
        self,
        comm: Comm,
        params: np.ndarray,
        workers: list[int],
        steps: int,
        lr: float,
        mode: Consistency,
        watch: Watch,
        gate: Gate = may_start,
    ):
        self.comm, self.params, self.workers, self.steps = comm, params.copy(), workers, steps
        self.lr, self.mode, self.watch, self.gate = lr, mode, watch, gate
        self.clock = dict.fromkeys(workers, 0)
        self.running = set(workers)  # have not sent their last gradient
        self.waiting = set(workers)  # want parameters for step clock[w]
        self.pending: dict[int, tuple[int, np.ndarray]] = {}  # synchronous: worker -> (step, gradient)
        self.version = 0
        self.sends: list[tuple[MPI.Request, np.ndarray]] = []
        self.log = ServerLog()
        self.began = time.perf_counter()
        self._snapshot()

    def _snapshot(self) -> None:
        self.log.snapshots.append((time.perf_counter() - self.began, self.version, self.params.copy()))

    def send_parameters(self, worker: int, go: bool) -> None:
        """Post [version, go] + this slice to worker (go = False: stop)."""
        buf = np.concatenate([[self.version, float(go)], self.params])
        self.sends.append((self.comm.Isend(buf, worker, PARAMETERS), buf))

    def release(self) -> None:
        """Send parameters to every waiting worker the gate lets start its next step."""
        clocks = np.array([self.clock[w] for w in sorted(self.running)], dtype=np.int64)
        for worker in sorted(self.waiting):
            if self.gate(clocks, self.clock[worker], self.mode.bound):
                self.log.releases.append((worker, self.clock[worker], int(clocks.min()) if len(clocks) else -1))
                self.waiting.discard(worker)
                self.send_parameters(worker, go=True)

    def stop(self, problem: str) -> None:
        """Give up: tell every waiting worker to stop, report the gradients never applied.

        Workers still computing are told to stop when their next gradient arrives (`serve`).
        """
        self.log.problem = problem
        self.log.dropped += [(w, step) for w, (step, _) in sorted(self.pending.items())]
        self.pending.clear()
        for worker in sorted(self.waiting):
            self.send_parameters(worker, go=False)
            self.running.discard(worker)
        self.waiting.clear()

    def receive(self) -> tuple[int, int, int, bool, np.ndarray]:
        """Wait for the next gradient from any worker: (worker, step, version, more, gradient)."""
        buf = np.empty(GRADIENT_HEADER + len(self.params))
        request = self.comm.Irecv(buf, MPI.ANY_SOURCE, GRADIENT)
        try:
            self.watch.poll(request.Test, f"a gradient from workers {sorted(self.running)}")
        except (Stalled, PeerFailed):
            if request != MPI.REQUEST_NULL:  # still open (a request the watch gave up is complete already)
                request.Cancel()
                request.Wait()
            raise
        worker, step, version, more = (int(x) for x in buf[:GRADIENT_HEADER])
        return worker, step, version, bool(more), buf[GRADIENT_HEADER:]

    def apply(self, worker: int, step: int, version: int, grad: np.ndarray) -> None:
        """Asynchronous and stale-synchronous: apply this gradient now (rate lr / workers)."""
        self.params -= self.lr / len(self.workers) * grad
        self.log.applied[worker, step] += 1
        self.log.staleness.append(self.version - version)
        self.version += 1
        self._snapshot()

    def apply_average(self) -> None:
        """Synchronous: apply the mean of every worker's gradient for this step, once."""
        steps = {step for step, _ in self.pending.values()}
        assert len(steps) == 1, f"a synchronous step mixes gradients of steps {sorted(steps)}"
        self.params -= self.lr * np.mean([g for _, g in self.pending.values()], axis=0)
        for worker, (step, _) in self.pending.items():
            self.log.applied[worker, step] += 1
            self.log.staleness.append(0)
        self.pending.clear()
        self.version += 1
        self._snapshot()

    def serve(self) -> ServerLog:
        """Run until every worker has sent its last gradient (or the protocol cannot go on)."""
        self.release()
        while self.running:
            if self.running <= self.waiting and not self.pending:
                self.stop(
                    f"deadlock: workers {sorted(self.waiting)} all wait and the gate lets none start "
                    f"(clocks {[self.clock[w] for w in sorted(self.waiting)]}, bound {self.mode.bound})"
                )
                break
            try:
                worker, step, version, more, grad = self.receive()
            except Stalled as err:
                silent = sorted(self.running - self.waiting)
                self.stop(f"workers {silent} sent nothing for {self.watch.timeout:.0f} s (did they die?): {err}")
                break
            if self.log.problem is not None:  # stopping: this gradient is reported, its worker stopped
                self.log.dropped.append((worker, step))
                self.running.discard(worker)
                if more:
                    self.send_parameters(worker, go=False)
                continue
            if step != self.clock[worker]:
                raise RuntimeError(f"worker {worker} sent a gradient for step {step}, expected {self.clock[worker]}")
            self.clock[worker] += 1
            if not more:
                self.running.discard(worker)
                if self.clock[worker] < self.steps:
                    self.log.early[worker] = self.clock[worker]
            if self.mode.average:
                self.pending[worker] = (step, grad.copy())
                if len(self.pending) == len(self.workers):
                    self.apply_average()
            else:
                self.apply(worker, step, version, grad)
            if more:
                self.waiting.add(worker)
            gone = [w for w in self.workers if w not in self.running and w not in self.pending]
            if self.mode.average and self.pending and gone:
                self.stop(
                    f"synchronous step {step} can never complete: workers {gone} stopped early "
                    f"(after {[self.clock[w] for w in gone]} steps of {self.steps})"
                )
                continue
            self.release()
        self.watch.poll(lambda: all(r.Test() for r, _ in self.sends), "workers to receive their parameters")
        return self.log
