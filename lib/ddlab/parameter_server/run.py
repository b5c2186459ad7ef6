"""Train the least-squares problem in any mode on a communicator; every rank gets the same record.

Modes: "sync", "async", "ssp<k>" (a parameter server on the first `servers` ranks,
the others workers), "allreduce" (every rank a worker, gradients averaged by
MPI's allreduce each step) and "gossip" (every rank a worker, asynchronous
averaging with the left ring neighbour); `allreduce` plugs in any allreduce with
lab 03's signature (MPI's by default). Worker k computes for `compute` seconds
times its slowdown per step: one seeded steady straggler at `straggler` times, or
`schedule[k, t]` for worker k's step t (`straggler.transient`, for one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..allreduce import Allreduce, allreduce_mpi
from ..runtime.comm import Comm
from ..runtime.counting import CountingComm, underlying
from ..runtime.waiting import Watch
from .gate import Consistency, may_start
from .gossip import AsyncGossip
from .messages import shard_bounds
from .problem import LeastSquares
from .server import Gate, Server, ServerLog
from .straggler import steady
from .worker import WorkerLog, work


@dataclass
class Record:
    """What a run did, the same on every rank."""

    mode: str
    params: np.ndarray  # final parameters (the servers', or the mean over ranks)
    curve: list[tuple[float, float, float]]  # (seconds, steps, loss); async steps = updates / workers
    seconds: float
    servers: list[ServerLog] = field(default_factory=list)
    workers: list[WorkerLog] = field(default_factory=list)
    divergence: list[float] = field(default_factory=list)  # gossip: max distance of a rank from the mean, per step

    @property
    def problem(self) -> str | None:
        """The first problem a server reported, or None."""
        return next((log.problem for log in self.servers if log.problem), None)

    @property
    def staleness(self) -> list[int]:
        return [s for log in self.servers for s in log.staleness]

    def time_to(self, loss: float) -> float:
        """Seconds until the loss first fell to `loss` (inf if it never did)."""
        return next((t for t, _, value in self.curve if value <= loss), float("inf"))

    def at_step(self, step: float) -> tuple[float, float]:
        """(seconds, loss) when `step` steps were first done (async and ssp: step x workers updates); (inf, nan) if never."""
        return next(((t, loss) for t, done, loss in self.curve if done >= step), (float("inf"), float("nan")))


def train(
    comm: Comm,
    mode: str,
    problem: LeastSquares,
    steps: int,
    lr: float = 0.05,
    *,
    servers: int = 1,
    compute: float = 0.0,
    straggler: float = 1.0,
    seed: int = 0,
    early: dict[int, int] | None = None,
    timeout: float = 30.0,
    gate: Gate = may_start,
    allreduce: Allreduce | None = None,
    schedule: np.ndarray | None = None,
) -> Record:
    """Run `steps` steps of `mode` (a collective); the worker on rank r runs only early[r] steps if given (0: it dies silently).

    schedule: slowdown factors per (worker, step), instead of `straggler`'s one steady straggler."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    size = comm.Get_size()
    workers = size if mode in ("allreduce", "gossip") else size - servers
    if workers < 1:
        raise ValueError(f"{mode!r} with {servers} server(s) needs more than {servers} ranks, got {size}")
    if schedule is None:
        slow = steady(workers, steps, straggler, seed)
    elif np.shape(schedule) != (workers, steps) or np.min(schedule) < 1:
        raise ValueError(
            f"schedule must hold factors >= 1 for {workers} workers x {steps} steps, got shape {np.shape(schedule)}"
        )
    else:
        slow = np.asarray(schedule, dtype=float)
    private = None
    if isinstance(comm, CountingComm):  # a check counts the messages: run on its communicator, under its watch
        watch = comm.watch
    else:  # a duplicate: no message of this run meets another run's, not even one left for a dead worker
        comm = private = underlying(comm).Dup()
        watch = Watch(private, timeout)
    underlying(comm).Barrier()
    try:
        if mode in ("allreduce", "gossip"):
            return _decentralized(comm, mode, problem, steps, lr, compute * slow[comm.Get_rank()], watch, allreduce)
        return _parameter_server(comm, mode, problem, steps, lr, servers, compute * slow, early or {}, watch, gate)
    finally:
        if private is not None:
            watch.free()
            private.Free()


def _parameter_server(
    comm: Comm,
    mode: str,
    problem: LeastSquares,
    steps: int,
    lr: float,
    servers: int,
    compute: np.ndarray,
    early: dict[int, int],
    watch: Watch,
    gate: Gate,
) -> Record:
    rank, size = comm.Get_rank(), comm.Get_size()
    bounds = shard_bounds(problem.n, servers)
    workers = list(range(servers, size))
    began = time.perf_counter()
    log: ServerLog | WorkerLog
    if rank < servers:
        a, b = bounds[rank]
        server = Server(comm, problem.start()[a:b], workers, steps, lr, Consistency.parse(mode), watch, gate)
        log = server.serve()
    else:
        k = rank - servers
        log = work(
            comm,
            bounds,
            problem.n,
            rank,
            lambda w, t: problem.gradient(w, k, t),
            early.get(rank, steps),
            watch,
            compute[k],
        )
    seconds = time.perf_counter() - began
    raw = underlying(comm)
    logs = raw.allgather(log)
    server_logs: list[ServerLog] = logs[:servers]
    events = sorted((t, s, version, part) for s, slog in enumerate(server_logs) for t, version, part in slog.snapshots)
    params, curve = problem.start(), []
    per_step = 1 if Consistency.parse(mode).average else len(workers)
    for t, s, version, part in events:  # the full vector as the shards changed, one shard at a time
        a, b = bounds[s]
        params[a:b] = part
        curve.append((t, version / per_step, problem.loss(params)))
    return Record(mode, params, curve, raw.allreduce(seconds, op=MPI.MAX), server_logs, logs[servers:])


def _decentralized(
    comm: Comm,
    mode: str,
    problem: LeastSquares,
    steps: int,
    lr: float,
    compute: np.ndarray,
    watch: Watch,
    allreduce: Allreduce | None,
) -> Record:
    """Every rank a worker (computing compute[t] seconds at step t): allreduce gradients, or gossip parameters."""
    rank, size, raw = comm.Get_rank(), comm.Get_size(), underlying(comm)
    gossip = AsyncGossip(comm, problem.n, watch) if mode == "gossip" else None
    params = problem.start()
    history = [(0.0, params.copy())]
    began = time.perf_counter()
    for step in range(steps):
        grad = problem.gradient(params, rank, step)
        time.sleep(max(0.0, compute[step] - (time.perf_counter() - began - history[-1][0])))
        if gossip is None:
            total = allreduce(comm, grad) if allreduce else allreduce_mpi(raw, grad)
            params = params - lr * total / size
        else:
            params = gossip.step(params - lr * grad)
        history.append((time.perf_counter() - began, params.copy()))
    if gossip is not None:
        gossip.finish()
    seconds = raw.allreduce(time.perf_counter() - began, op=MPI.MAX)
    every = np.array(raw.allgather(np.array([p for _, p in history])))  # rank, step, parameter
    mean = every.mean(axis=0)
    divergence = np.linalg.norm(every - mean, axis=2).max(axis=0)
    times = np.max(raw.allgather(np.array([t for t, _ in history])), axis=0)
    curve = [(float(t), float(step), problem.loss(w)) for step, (t, w) in enumerate(zip(times, mean))]
    return Record(mode, mean[-1], curve, seconds, divergence=[float(d) for d in divergence])


def train_on_workers(
    comm: Comm,
    mode: str,
    problem: LeastSquares,
    steps: int,
    lr: float = 0.05,
    *,
    servers: int = 1,
    compute: float = 0.0,
    straggler: float = 1.0,
    seed: int = 0,
    schedule: np.ndarray | None = None,
) -> Record:
    """`train` with the same workers in every mode (a collective): ranks servers.. are the workers.

    Server modes run on all of comm; "allreduce" and "gossip" run on the worker ranks
    alone while the server ranks wait, so a comparison never gives the decentralized
    modes more workers (nor a different straggler: worker k is rank servers + k in both).
    Every rank gets the record.
    """

    def run(on: Comm, shards: int) -> Record:
        return train(
            on,
            mode,
            problem,
            steps,
            lr,
            servers=shards,
            compute=compute,
            straggler=straggler,
            seed=seed,
            schedule=schedule,
        )

    if mode not in ("allreduce", "gossip"):
        return run(comm, servers)
    raw, rank = underlying(comm), comm.Get_rank()
    sub = raw.Split(0 if rank >= servers else MPI.UNDEFINED, rank)
    record = None
    if sub != MPI.COMM_NULL:
        record = run(sub, servers)
        sub.Free()
    return raw.bcast(record, root=servers)
