"""Parameter servers under mpiexec: sync equals allreduce, bounded staleness, exactly-once updates, early stops,
the same workers in every mode, a pluggable allreduce, step timings."""

import numpy as np
import pytest
from ddlab.allreduce import allreduce_mpi, allreduce_ring
from ddlab.parameter_server import LeastSquares, train
from ddlab.parameter_server.cost import seconds_per_step
from ddlab.parameter_server.run import train_on_workers
from mpi4py import MPI

PROBLEM = LeastSquares(n=12, samples=256, batch=8)
STEPS = 12


def workers(comm, servers=1):
    return range(servers, comm.Get_size())


def exactly_once(record, comm, servers=1):
    for log in record.servers:
        want = {(w, t): 1 for w in workers(comm, servers) for t in range(STEPS)}
        assert dict(log.applied) == want


@pytest.mark.parametrize("servers", [1, 2])
def test_synchronous_server_equals_allreduce_data_parallel(comm, servers):
    record = train(comm, "sync", PROBLEM, STEPS, servers=servers)
    rank = comm.Get_rank()
    sub = comm.Split(0 if rank >= servers else MPI.UNDEFINED, rank)
    reference = None
    if sub != MPI.COMM_NULL:
        reference = train(sub, "allreduce", PROBLEM, STEPS).params
        sub.Free()
    reference = comm.bcast(reference, root=servers)
    assert record.problem is None
    np.testing.assert_allclose(record.params, reference, rtol=1e-12, atol=1e-14)
    exactly_once(record, comm, servers)


@pytest.mark.parametrize("mode,bound", [("sync", 0), ("ssp1", 1), ("ssp2", 2), ("async", np.inf)])
def test_staleness_bound_never_exceeded_and_every_update_applied_once(comm, mode, bound):
    record = train(comm, mode, PROBLEM, STEPS, compute=0.002, straggler=3.0, seed=1)
    assert record.problem is None
    exactly_once(record, comm)
    releases = record.servers[0].releases
    assert len(releases) == (comm.Get_size() - 1) * STEPS
    assert all(step - slowest <= bound for _, step, slowest in releases)
    assert all(s >= 0 for s in record.staleness)
    if mode == "sync":
        assert set(record.staleness) == {0}


def test_sharded_stale_synchronous_applies_every_update_once(comm):
    servers = min(2, comm.Get_size() - 1)
    record = train(comm, "ssp1", PROBLEM, STEPS, servers=servers, compute=0.001, straggler=2.0)
    exactly_once(record, comm, servers)


def test_asynchronous_server_goes_on_when_a_worker_stops_early(comm):
    last = comm.Get_size() - 1
    record = train(comm, "async", PROBLEM, STEPS, early={last: 3})
    assert record.problem is None
    assert record.servers[0].early == {last: 3}
    applied = record.servers[0].applied
    assert sum(applied[last, t] for t in range(STEPS)) == 3
    assert all(applied[w, t] == 1 for w in workers(comm) if w != last for t in range(STEPS))


def test_synchronous_server_reports_a_worker_that_stops_early(comm):
    last = comm.Get_size() - 1
    record = train(comm, "sync", PROBLEM, STEPS, early={last: 3})
    log = record.servers[0]
    assert "can never complete" in record.problem and str(last) in record.problem
    pushed = {(w, t) for w, wlog in zip(workers(comm), record.workers) for t in wlog.pushed}
    accounted = list(log.applied.elements()) + log.dropped
    assert sorted(accounted) == sorted(pushed)  # each gradient sent: applied once or reported


def test_a_worker_that_dies_is_reported_not_waited_for(comm):
    last = comm.Get_size() - 1
    record = train(comm, "async", PROBLEM, STEPS, early={last: 0}, timeout=3.0)
    assert "did they die" in record.problem and str(last) in record.problem


def test_gossip_stays_finite_and_replicas_drift_apart(comm):
    record = train(comm, "gossip", PROBLEM, STEPS, compute=0.001, straggler=2.0)
    assert np.all(np.isfinite(record.params))
    assert record.curve[-1][2] < record.curve[0][2]
    if comm.Get_size() > 1:
        assert max(record.divergence) > 0


def test_every_mode_gets_the_same_workers(comm):
    servers = 1
    server = train_on_workers(comm, "sync", PROBLEM, STEPS, servers=servers)
    ring = train_on_workers(comm, "allreduce", PROBLEM, STEPS, servers=servers)
    np.testing.assert_allclose(ring.params, server.params, rtol=1e-12, atol=1e-14)
    assert len(ring.curve) == STEPS + 1


def test_a_pluggable_allreduce_trains_like_mpis(comm):
    ours = train(comm, "allreduce", PROBLEM, STEPS, allreduce=allreduce_ring)
    mpis = train(comm, "allreduce", PROBLEM, STEPS, allreduce=allreduce_mpi)
    np.testing.assert_allclose(ours.params, mpis.params, rtol=1e-12, atol=1e-14)


def test_seconds_per_step_is_measured_and_agreed(comm):
    seconds = seconds_per_step(comm, "sync", comm.Get_size() - 1, 64, steps=2, repeats=1)
    assert seconds > 0 and comm.allgather(seconds) == [seconds] * comm.Get_size()
    with pytest.raises(ValueError, match="needs"):
        seconds_per_step(comm, "sync", comm.Get_size(), 64)
