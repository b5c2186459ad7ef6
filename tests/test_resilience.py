"""Lab 19's library under real failures: ranks SIGKILLed in fault-tolerant (ULFM) jobs, the survivors go on.

Each test starts a job of its own (`ddlab.resilience.run_job`: mpiexec --with-ft ulfm, killed whole
at its deadline) on 4 and on 3 ranks. A rank dies at a random point of a data-parallel or a ZeRO-3
step (a random call of its gradient, then a random delay of up to 2 ms from a timer, so the kill
lands in the gradient, the collectives or the update); then a second rank dies after the first was
survived. The survivors must finish with one process's losses over the same samples (float64,
1e-10), every survivor the same list. The interval's formulas are checked against their papers'
properties and against the run with failures drawn at random.
"""

from __future__ import annotations

import math
import random

import numpy as np
import psutil
import pytest
from ddlab import resilience
from ddlab.resilience import Failure, Regression, run_job

STEPS = 16
DEADLINE = 120.0  # seconds per job, under load; a job that hangs after a kill is itself a failure
PROBLEM = Regression(samples=96, features=5, batch=10)
TRAINERS = {"data_parallel": resilience.train_resilient, "zero3": resilience.train_zero3_resilient}


def _random_failures(seed: int, ranks: int, count: int) -> list[Failure]:
    """`count` deaths of distinct ranks, the second well after the first was survived."""
    rng = random.Random(seed)
    victims = rng.sample(range(ranks), count)
    calls = sorted(rng.sample(range(1, 6), 1) + rng.sample(range(9, STEPS - 2), 1))[:count]
    return [Failure(rank, call, rng.uniform(0.0, 0.002)) for rank, call in zip(victims, calls)]


def _run(trainer: str, ranks: int, failures: list[Failure]) -> resilience.JobResult:
    def target(comm):  # run on every rank of the job
        return TRAINERS[trainer](comm, resilience.probe(PROBLEM, failures), STEPS)

    return run_job(target, ranks, DEADLINE)


@pytest.mark.parametrize(("ranks", "deaths"), [(4, 1), (4, 2), (3, 2)])  # on 3 ranks the first death is covered too
@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_survivors_train_as_one_process(trainer: str, ranks: int, deaths: int) -> None:
    failures = _random_failures(random.randrange(10**6), ranks, deaths)  # named in every assertion's message
    result = _run(trainer, ranks, failures)
    assert not result.timed_out, f"{failures}: the job did not finish within {DEADLINE} s\n{result.output[-3000:]}"
    dead = {f.rank for f in failures}
    assert result.survivors() == [r for r in range(ranks) if r not in dead], (failures, result.output[-3000:])
    want, _ = PROBLEM.one_process(STEPS)
    for rank, outcome in result.outcomes.items():
        assert outcome.error is None, f"rank {rank}: {outcome.error}"
        assert len(outcome.value) == STEPS
        np.testing.assert_allclose(outcome.value, want, rtol=1e-10, atol=0, err_msg=f"rank {rank}, {failures}")
    # every step's last attempt on the survivors used the global batch exactly once
    last = {rank: calls[-1] for rank, calls in result.calls.items() if rank not in dead}
    assert sorted(sum(last.values(), [])) == sorted(PROBLEM.batch_ids(STEPS - 1).tolist())


def test_a_job_that_hangs_is_killed_whole_at_its_deadline() -> None:
    def target(comm):
        import time

        time.sleep(600)

    result = run_job(target, 3, 4.0)
    assert result.timed_out and not result.outcomes
    left = [
        p for p in psutil.process_iter(["cmdline"]) if "ddlab.resilience.runner" in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, f"processes left behind: {left}"


def test_detect_tells_arrived_dead_and_slow() -> None:
    def target(comm):
        import os
        import signal
        import time

        import numpy as np

        rank = comm.Get_rank()
        if rank == 1:
            comm.Send(np.ones(3), dest=0, tag=5)
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 3:
            time.sleep(2.0)  # longer than rank 0's timeout: slow, not dead
            return "late"
        if rank == 0:
            return [resilience.detect(comm, source, 0.5) for source in (1, 2, 3)]
        return None

    result = run_job(target, 4, DEADLINE)
    assert result.outcomes[0].value == ["arrived", "dead", "slow"], result.outcomes[0]
    assert 2 not in result.outcomes and result.outcomes[3].value == "late"


def test_recover_agrees_on_the_smallest_step() -> None:
    def target(comm):
        import os
        import signal

        from mpi4py import MPI

        if comm.Get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:  # the buffer Allreduce, as the library's training: the object allreduce first duplicates comm
            comm.Allreduce(MPI.IN_PLACE, np.ones(1))
        except MPI.Exception as err:
            assert resilience.is_failure(err), f"Allreduce raised {err.Get_error_string()}, not a peer's failure"
        survivors, step = resilience.recover(comm, done=7 + comm.Get_rank() % 2)
        return survivors.Get_size(), step, survivors.allreduce(comm.Get_rank())

    result = run_job(target, 4, DEADLINE)
    assert {r: o.value for r, o in result.outcomes.items()} == {r: (3, 7, 5) for r in (0, 2, 3)}


def test_rebuild_shards_from_buddies() -> None:
    flat = np.arange(1.0, 12.0)
    old = [resilience.reshard([flat], flat.size, 4, q) for q in range(4)]
    assert [s.size for s in old] == [3, 3, 3, 3] and old[3].tolist() == [10.0, 11.0, 0.0]
    three = [resilience.reshard(old, flat.size, 3, r) for r in range(3)]
    assert np.concatenate(three)[: flat.size].tolist() == flat.tolist()


def test_young_and_daly() -> None:
    cost, mtbf = 30.0, 3600.0
    young = resilience.young_interval(cost, mtbf)
    assert young == pytest.approx(math.sqrt(2 * cost * mtbf))
    # Young's interval is near the expected goodput's maximum; Daly's nearer still
    grid = np.linspace(0.2 * young, 4 * young, 2000)
    best = grid[np.argmax([resilience.expected_goodput(t, cost, mtbf) for t in grid])]
    assert abs(resilience.daly_interval(cost, mtbf) - best) < abs(young - best) < 0.1 * young
    assert resilience.expected_goodput(young, cost, mtbf) == pytest.approx(1 - math.sqrt(2 * cost / mtbf), abs=0.01)
    with pytest.raises(ValueError, match="mean time between failures"):
        resilience.young_interval(0.0, mtbf)


def test_simulated_goodput_matches_the_model() -> None:
    cost, mtbf, restart = 2.0, 100.0, 5.0
    for interval in (5.0, 20.0, 60.0):
        rng = np.random.default_rng(int(interval))
        runs = [resilience.simulate_goodput(interval, cost, mtbf, restart, 20_000.0, rng) for _ in range(10)]
        assert np.mean(runs) == pytest.approx(resilience.expected_goodput(interval, cost, mtbf, restart), rel=0.03)


def test_llama3_rates() -> None:
    rate = resilience.interruption_rate()
    assert resilience.mtbf_at(16_384, rate) / 3600 == pytest.approx(54 * 24 / 419)  # about 3.1 hours
    need = resilience.bandwidth_for(0.9, 1e13, resilience.mtbf_at(16_384, rate), restart=600.0)
    cost = resilience.checkpoint_cost(1e13, need)
    young = resilience.young_interval(cost, resilience.mtbf_at(16_384, rate))
    assert resilience.expected_goodput(young, cost, resilience.mtbf_at(16_384, rate), 600.0) == pytest.approx(0.9)


def test_the_launcher_knows_ulfm() -> None:
    from ddlab.runtime import mpi

    if mpi.implementation() != "openmpi":
        assert "Open MPI" in (mpi.ulfm_problem() or "")
        return
    assert mpi.ulfm_problem() is None
    assert mpi.launcher_args(4, fault_tolerant=True)[-2:] == ["--with-ft", "ulfm"]
    assert "--with-ft" not in mpi.launcher_args(4)


def test_the_doctor_says_whether_the_mpi_has_ulfm() -> None:
    from ddlab.runtime import mpi
    from ddlab.tools import doctor

    finding = doctor.check_fault_tolerance()
    assert finding.check == "fault tolerance (ULFM)"
    if mpi.implementation() == "openmpi":
        assert finding.status == doctor.OK, finding
    else:
        assert finding.status == doctor.WARN and "Open MPI" in finding.fix
