"""One-process parts of the parameter server lab: gate, modes, straggler, shards, one-rank runs."""

import math

import numpy as np
import pytest
from ddlab.parameter_server import Consistency, LeastSquares, gossip_step, may_start, slowdowns, train
from ddlab.parameter_server.messages import shard_bounds
from ddlab.parameter_server.replay import compare_bounds, replay
from ddlab.parameter_server.straggler import steady, transient
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


def test_steady_and_transient_stragglers_have_the_same_slow_steps():
    lasting, passing = steady(3, 8, 3.0, seed=1), transient(3, 8, 3.0, spell=2, seed=1)
    assert lasting.shape == passing.shape == (3, 8)
    assert np.array_equal(np.sort(lasting, axis=0), np.sort(passing, axis=0))  # one worker at 3x in every step
    assert len({tuple(row) for row in lasting}) == 2  # the same worker at every step
    assert np.count_nonzero(passing.max(axis=1) > 1) > 1  # several workers take turns
    assert all(len(set(passing[:, t : t + 2].argmax(axis=0))) == 1 for t in range(0, 8, 2))  # spells of 2 steps
    with pytest.raises(ValueError, match="spell"):
        transient(3, 8, 3.0, spell=0)
    with pytest.raises(ValueError, match="factor must be >= 1"):
        steady(3, 8, 0.5)


def test_replay_keeps_the_bound_and_times_bsp_by_the_slowest_worker_of_each_step():
    problem = LeastSquares(n=4, samples=64, batch=8)
    delay = transient(3, 10, 3.0, spell=2, seed=1)
    bsp = replay(problem, delay, 0, 0.1)
    assert bsp.times[-1] == pytest.approx(delay.max(axis=0).sum())  # each step waits for its slowest
    assert len(bsp.history) == 31 and sorted(bsp.order) == [(k, t) for k in range(3) for t in range(10)]
    for bound in (0, 1, 2, math.inf):
        run = replay(problem, delay, bound, 0.1)
        done = np.zeros(3, dtype=int)  # steps each worker has finished, update by update
        for k, t in run.order:
            assert t == done[k]
            done[k] += 1
        for (_, t), version in run.released.items():  # started only when the slowest was within the bound
            finished = np.bincount([w for w, _ in run.order[:version]], minlength=3)
            assert t - finished[finished < 10].min(initial=t) <= bound
    async_run = replay(problem, delay, math.inf, 0.1)
    assert async_run.times[-1] == pytest.approx(delay.sum(axis=1).max())  # nobody waits
    assert replay(problem, delay, 2, 0.1, updates=12).times[-1] < bsp.times[11]
    with pytest.raises(ValueError, match="updates must lie"):
        replay(problem, delay, 1, 0.1, updates=31)
    with pytest.raises(ValueError, match="bound"):
        replay(problem, delay, 1.5, 0.1)


def test_a_schedule_must_fit_the_workers_and_steps():
    problem = LeastSquares(n=4, samples=64, batch=8)
    record = train(MPI.COMM_SELF, "allreduce", problem, 4, schedule=np.ones((1, 4)))
    never = record.at_step(5)
    assert record.at_step(4)[0] < math.inf and never[0] == math.inf and math.isnan(never[1])
    with pytest.raises(ValueError, match="schedule must hold factors >= 1 for 1 workers x 4 steps"):
        train(MPI.COMM_SELF, "allreduce", problem, 4, schedule=np.ones((2, 4)))


def test_compare_bounds_averages_replays_over_seeds():
    kinds = {
        "steady": lambda seed: steady(3, 6, 3.0, seed=seed),
        "transient": lambda seed: transient(3, 6, 3.0, seed=seed),
    }
    comparison = compare_bounds(
        kinds, lambda seed: LeastSquares(n=4, samples=64, batch=8, seed=seed), [0, math.inf], 0.1, 9, [0, 1]
    )
    assert comparison.time["steady"][0] == comparison.time["transient"][0] == 9.0  # BSP: 3 steps of the slowest
    assert comparison.time["steady"][1] < 9.0 and comparison.staleness["steady"][1] > comparison.staleness["steady"][0]
    problems = [LeastSquares(n=4, samples=64, batch=8, seed=seed) for seed in (0, 1)]
    losses = [
        p.loss(replay(p, transient(3, 6, 3.0, seed=seed), 0, 0.1, 9).history[-1]) for seed, p in zip((0, 1), problems)
    ]
    assert comparison.loss["transient"][0] == pytest.approx(np.mean(losses))
    assert "async" in comparison.table() and comparison.best < min(losses)
