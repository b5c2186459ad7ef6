"""Failures at scale (lab 19): detect a dead rank, shrink, rebuild the lost state, and go on; when to checkpoint.

Built on ULFM (User-Level Failure Mitigation: Open MPI 5 launched `--with-ft ulfm`, mpi4py's Comm.Revoke,
Shrink, Agree, Ack_failed), on communicators whose errors are returned (MPI.ERRORS_RETURN).

- detector.py: `detect(comm, source, timeout)` -> "arrived" | "dead" | "slow"; `is_failure(err)`.
- recovery.py: `recover(comm, done)` -> (survivors, agreed step); `train_resilient(comm, problem, steps)`.
- buddy.py: `reshard` (lab 13's), `rebuild_shards(comm, old_rank, old_size, mine, buddy, numel)`,
  `train_zero3_resilient(comm, problem, steps)`: in-memory buddy checkpoints of ZeRO-3 shards.
- interval.py: `young_interval`, `daly_interval`, `expected_goodput`, `simulate_goodput`, Llama 3's rates.
- problem.py: `Regression`, the float64 problem every fault-tolerant run must train exactly as one process.
- job.py: `run_job(target, n, timeout)`, `Failure`, `probe`: jobs of their own where ranks are killed for real.
"""

from .buddy import rebuild_shards, reshard, train_zero3_resilient
from .detector import FAILURE_CLASSES, detect, is_failure
from .interval import (
    bandwidth_for,
    checkpoint_cost,
    daly_interval,
    expected_goodput,
    interruption_rate,
    mtbf_at,
    simulate_goodput,
    young_interval,
)
from .job import Failure, JobResult, Outcome, probe, run_job
from .problem import Regression
from .recovery import attempt, recover, train_resilient

__all__ = [
    "FAILURE_CLASSES",
    "Failure",
    "JobResult",
    "Outcome",
    "Regression",
    "attempt",
    "bandwidth_for",
    "checkpoint_cost",
    "daly_interval",
    "detect",
    "expected_goodput",
    "interruption_rate",
    "is_failure",
    "mtbf_at",
    "probe",
    "rebuild_shards",
    "recover",
    "reshard",
    "run_job",
    "simulate_goodput",
    "train_resilient",
    "train_zero3_resilient",
    "young_interval",
]
