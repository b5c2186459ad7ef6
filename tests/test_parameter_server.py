"""One-process parts of the parameter server lab: gate, modes, straggler, shards, one-rank runs."""

import math

import numpy as np
import pytest
from ddlab.parameter_server import Consistency, LeastSquares, gossip_step, may_start, slowdowns, train
from ddlab.parameter_server.messages import shard_bounds
from mpi4py import MPI


def test_gate_lets_a_worker_run_at_most_bound_steps_ahead():
    clocks = np.array([3, 5, 4])
    assert may_start(clocks, 3, 0) and not may_start(clocks, 4, 0)
    assert may_start(clocks, 5, 2) and not may_start(clocks, 6, 2)
    assert may_start(clocks, 100, math.inf)
    assert may_start(np.array([], dtype=np.int64), 7, 0)


def test_modes_parse_and_bad_modes_say_what_to_use():
    assert Consistency.parse("sync") == Consistency(0, average=True)
    assert Consistency.parse("ssp2").bound == 2 and Consistency.parse("async").bound == math.inf
    with pytest.raises(ValueError, match="ssp<k>"):
        Consistency.parse("stale")


def test_straggler_is_seeded_and_one_worker_only():
    a, b = slowdowns(5, 2.0, seed=3), slowdowns(5, 2.0, seed=3)
    assert np.array_equal(a, b) and sorted(a) == [1, 1, 1, 1, 2]
    with pytest.raises(ValueError):
        slowdowns(3, 0.5)


def test_shards_cover_every_parameter_once():
    bounds = shard_bounds(10, 3)
    assert bounds[0][0] == 0 and bounds[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_one_rank_runs_decentralized_modes_and_refuses_a_server_without_workers():
    problem = LeastSquares(n=4, samples=64, batch=8)
    record = train(MPI.COMM_SELF, "allreduce", problem, 20)
    assert record.curve[-1][2] < record.curve[0][2]
    assert np.array_equal(gossip_step(MPI.COMM_SELF, np.ones(3)), np.ones(3))
    with pytest.raises(ValueError, match="needs more than 1 ranks"):
        train(MPI.COMM_SELF, "sync", problem, 5)
