"""Fault-tolerant jobs of their own: run a function on n ranks under ULFM, kill ranks for real, read what survived.

`run_job(target, n, timeout)` pickles `target` (cloudpickle: a notebook's functions travel by value),
starts `python -m ddlab.resilience.runner FOLDER` on n ranks with `mpiexec --with-ft ulfm`
(`ddlab.runtime.mpi`, fault_tolerant=True), and on each rank calls `target(comm)`, comm a duplicate of
the world whose errors are returned (MPI.ERRORS_RETURN), so a dead peer is an exception to handle.
Each rank's outcome goes to a file; ranks that die leave none. Once every rank has exited, the launcher (which,
under ULFM, may outlive a job with a dead rank) is stopped after `mpi.LAUNCHER_GRACE` s. At the deadline the whole
job is killed (mpiexec and every rank of its session: no orphan), and the outcomes written so far are still read,
with the stack of every rank still running shortly before it (`stacks`: where it waited) and which ranks got
through MPI's start-up (`started`).

`Failure(rank, call, delay)` is a death planned by `Probe`, the problem wrapper the job's ranks train
on: world rank `rank` is SIGKILLed at its `call`-th `loss_and_grad`, at once (delay 0) or `delay`
seconds later from a timer (landing anywhere: in the gradient, the allreduce, the update). The probe
also logs, per rank, which samples each call used, so a check can say which were lost or counted twice.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .problem import Regression


@dataclass(frozen=True)
class Failure:
    """World rank `rank` dies (SIGKILL) at its `call`-th loss_and_grad (1 = the first), `delay` s after it starts."""

    rank: int
    call: int
    delay: float = 0.0


@dataclass
class Outcome:
    """What one rank left: its return value, or the error it raised (error_class: MPI's, if an MPI error)."""

    value: Any = None
    error: str | None = None
    error_class: int | None = None


@dataclass
class JobResult:
    """The outcomes of a job's ranks (dead ranks have none), whether it was killed at the deadline, its output."""

    outcomes: dict[int, Outcome]
    timed_out: bool
    output: str
    calls: dict[int, list[list[int]]] = field(default_factory=dict)  # rank -> the sample ids of each call
    stacks: dict[int, str] = field(default_factory=dict)  # rank -> where it was near the deadline, if still running
    started: set[int] = field(default_factory=set)  # the ranks that got through MPI's start-up
    ranks: int = 0  # the job's size

    def survivors(self) -> list[int]:
        return sorted(self.outcomes)


class Probe:
    """A Regression that kills its rank as planned and logs each call's samples (to `log`, one JSON line each).

    The kill comes `delay` s into the planned call, from a timer, so it lands in the gradient, the
    collectives or the update; a rank that reaches its next call first waits there to be killed."""

    def __init__(self, problem: Regression, failures: list[Failure], rank: int, log: Path):
        self.problem, self.rank, self.log, self.calls = problem, rank, log, 0
        self.doomed = False  # a kill is armed: the rank must not outrun its timer (a fast step could finish the run)
        self.failures = [f for f in failures if f.rank == rank]
        self.batch, self.lr = problem.batch, problem.lr

    def initial(self) -> np.ndarray:
        return self.problem.initial()

    def batch_ids(self, step: int) -> np.ndarray:
        return self.problem.batch_ids(step)

    def loss_and_grad(self, params: np.ndarray, ids: np.ndarray) -> tuple[float, np.ndarray]:
        if self.doomed:  # the kill armed at an earlier call has not landed yet: it lands here at the latest
            threading.Event().wait()
        self.calls += 1
        with self.log.open("a") as out:
            out.write(json.dumps([int(i) for i in np.asarray(ids).ravel()]) + "\n")
        for failure in self.failures:
            if failure.call == self.calls:
                if failure.delay <= 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                timer = threading.Timer(failure.delay, os.kill, (os.getpid(), signal.SIGKILL))
                timer.daemon = True
                timer.start()
                self.doomed = True
        return self.problem.loss_and_grad(params, ids)


def probe(problem: Regression, failures: list[Failure]) -> Probe:
    """The probe of this rank of a running job (call it inside the job's target)."""
    from mpi4py import MPI

    folder = Path(os.environ["DDLAB_JOB_FOLDER"])
    rank = MPI.COMM_WORLD.Get_rank()
    return Probe(problem, failures, rank, folder / f"calls.{rank}.jsonl")


def pid_file(folder: Path, rank: int) -> Path:
    """Where a rank of the job in `folder` writes its process id once through MPI's start-up (the runner)."""
    return folder / f"pid.{rank}"


def rank_alive(folder: Path, rank: int) -> bool:
    """Whether rank `rank` of the job in `folder` has not exited: not yet through MPI's start-up (no pid file), or
    its process running (not gone, not a zombie)."""
    import psutil

    file = pid_file(folder, rank)
    if not file.exists():
        return True
    try:
        return psutil.Process(int(file.read_text())).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ranks_ended(folder: Path, n: int) -> bool:
    """Whether every rank of the job in `folder` started (its pid file) and has exited (gone, or a zombie)."""
    if not all(pid_file(folder, rank).exists() for rank in range(n)):
        return False
    return not any(rank_alive(folder, rank) for rank in range(n))


def run_job(target: Callable[[Any], Any], n: int, timeout: float) -> JobResult:
    """Run target(comm) on n ranks of a fault-tolerant job; kill it all after `timeout` seconds."""
    import cloudpickle  # type: ignore[import-untyped]

    from ..runtime import mpi

    with tempfile.TemporaryDirectory(prefix="ddlab-job-") as tmp:
        folder = Path(tmp)
        (folder / "target.pkl").write_bytes(cloudpickle.dumps(target))
        (folder / "dump_after").write_text(str(max(1.0, 0.85 * timeout)))
        command = [sys.executable, "-m", "ddlab.resilience.runner", str(folder)]
        timed_out = False
        try:
            ended = functools.partial(_ranks_ended, folder, n)
            done = mpi.run_ranks(n, command, timeout=timeout, fault_tolerant=True, ended=ended)
            output = done.stdout or ""
        except subprocess.TimeoutExpired as err:
            timed_out, output = True, str(err.output or "")
        outcomes: dict[int, Outcome] = {}
        calls: dict[int, list[list[int]]] = {}
        stacks: dict[int, str] = {}
        for rank in range(n):
            result = folder / f"result.{rank}.pkl"
            if result.exists():
                outcomes[rank] = cloudpickle.loads(result.read_bytes())
            log = folder / f"calls.{rank}.jsonl"
            if log.exists():
                calls[rank] = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            stack = folder / f"stack.{rank}.txt"
            if stack.exists() and stack.stat().st_size:
                stacks[rank] = stack.read_text()
        started = {rank for rank in range(n) if pid_file(folder, rank).exists()}
        return JobResult(outcomes, timed_out, output, calls, stacks, started, n)
