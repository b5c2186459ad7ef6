"""The grader's draw: checks graded on cases the notebook never shows (ddlab.checks._draw).

With DDLAB_GRADE_SEED set (as `ddlab grade --seed S` sets it in the kernel and its engines), the
converted checks draw their lengths, dtypes, data and sub-communicators. Each answer below is fitted
to what the notebook's check runs: it passes the notebook's check, and fails under the grader's draw
with the drawn case named; the right answers pass under every seed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from ddlab import collectives, p2p
from ddlab.allreduce import allreduce_ring
from ddlab.checks import (
    CheckFailed,
    check_allreduce_bucketed,
    check_allreduce_ring,
    check_average_gradients,
    check_bcast_linear,
    check_bcast_tree,
    check_block_range,
    check_broadcast_parameters,
    check_collect,
    check_exchange,
    check_fit_alpha_beta,
    check_lr_factor,
    check_ping_pong,
    check_reduce_linear,
    check_reduce_tree,
    check_scaling_efficiency,
    check_shard_indices,
)
from ddlab.checks._draw import SEED_VARIABLE, Draw, grading_draw
from ddlab.checks.allreduce import DRAWN_DTYPES
from ddlab.collectives import bcast_linear
from ddlab.data.sharding import shard_indices
from ddlab.data_parallel.sync import average_gradients, broadcast_parameters
from ddlab.runtime.blocks import block_range
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

SHORT = 3.0  # seconds a fitted answer may wait for a message that never comes


def test_every_rank_draws_the_same_cases_and_each_seed_its_own(comm, seed, grading_seeds):
    assert grading_draw(comm, "allreduce_ring") is None, "no seed: the notebook's cases"
    drawn = {}
    for value in grading_seeds:
        seed(value)
        draw = grading_draw(comm, "allreduce_ring")
        assert draw is not None
        mine = (draw.ranks(4, 3), draw.lengths(5, 0, 100, "n"), draw.choose(DRAWN_DTYPES, 3), draw.data_seed(1))
        assert all(other == mine for other in comm.allgather(mine)), "every rank draws the same"
        again = grading_draw(comm, "allreduce_ring")
        assert again is not None and again.lengths(5, 0, 100, "n") == mine[1], "the same seed draws the same"
        drawn[value] = mine
    assert len({str(cases) for cases in drawn.values()}) == len(grading_seeds), "another seed, other cases"


def test_only_rank_0_s_seed_counts(comm, seed, monkeypatch):
    seed(5 if comm.Get_rank() == 0 else 6)
    draw = grading_draw(comm, "exchange")
    assert draw is not None and draw.seed == 5


@pytest.mark.parametrize("bad", ["seven", "-3"])
def test_a_bad_seed_fails_every_rank_saying_what_to_set(comm, seed, bad):
    seed(bad)
    with pytest.raises(CheckFailed, match=f"{SEED_VARIABLE}='{bad}' is not a grading seed: set it to a whole number"):
        grading_draw(comm, "exchange")


def test_the_drawn_sub_communicators_are_any_ranks_in_any_order():
    draw = Draw(3, "collect")
    members = [draw.ranks(8, p) for p in range(1, 9)]
    assert all(len(set(m)) == len(m) == p for p, m in zip(range(1, 9), members))
    assert any(m != list(range(len(m))) for m in members), "not the first P ranks in order"


# Answers fitted to the notebook's cases ------------------------------------------------


def collect_into_16(comm, data):
    """Lab 01's collect with a receive buffer big enough for the notebook's lengths (at most 12)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank != 0:
        comm.Send(data, dest=0)
        return None
    got = [data.copy()] + [None] * (size - 1)
    status = MPI.Status()
    for _ in range(size - 1):
        buf = np.empty(16)
        comm.Recv(buf, source=MPI.ANY_SOURCE, status=status)
        got[status.Get_source()] = buf[: status.Get_count(MPI.DOUBLE)].copy()
    return got


def exchange_of_int64(comm, data):
    """Lab 01's exchange receiving into int64, the dtype of the notebook's arrays."""
    rank, size = comm.Get_rank(), comm.Get_size()
    partner = rank ^ 1
    if partner >= size:
        return data.copy()
    got = np.empty(data.size, dtype=np.int64)
    comm.Sendrecv(data, dest=partner, recvbuf=got, source=partner)
    return got


def bcast_by_world_rank(comm, x, root=0):
    """Lab 02's linear broadcast numbering ranks by the world's rank: right on the first P ranks only."""
    rank, size = MPI.COMM_WORLD.Get_rank(), comm.Get_size()
    out = np.empty(x.shape, x.dtype)
    if rank == root:
        out[...] = x
        for dest in range(size):
            if dest != root:
                comm.Send(np.ascontiguousarray(x), dest=dest)
    else:
        comm.Recv(out, source=root)
    return out


ring = unguarded(allreduce_ring)
#: MPI datatypes for the three dtypes lab 03's check prints, and no others.
MPI_TYPES = {np.dtype(np.float64): MPI.DOUBLE, np.dtype(np.float32): MPI.FLOAT, np.dtype(np.int64): MPI.INT64_T}


def ring_of_three_dtypes(comm, x):
    """Lab 03's ring that names the MPI datatype of each dtype the notebook's check ran."""
    MPI_TYPES[x.dtype]  # KeyError on any other dtype
    return ring(comm, x)


def block_range_up_to_seven(n, rank, size):
    """Lab 00's block_range that is right for the notebook's sizes (at most 7 ranks) only."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra)) if size <= 7 else range(rank * base, (rank + 1) * base)


FITTED = [  # (check, the fitted answer, the right answer, words the failure names, what the seed must draw)
    (check_collect, collect_into_16, unguarded(p2p.collect), ["collect on", "lengths [", "seed"], None),
    (check_exchange, exchange_of_int64, unguarded(p2p.exchange), ["exchange of arrays of", "seed"], None),
    (
        check_bcast_linear,
        bcast_by_world_rank,
        unguarded(bcast_linear),
        ["bcast_linear", "of the check's communicator, in that order", "seed"],
        None,
    ),
    (
        check_allreduce_ring,
        ring_of_three_dtypes,
        ring,
        ["KeyError", "seed"],
        None,  # every draw holds a dtype the notebook's check never runs
    ),
]


@pytest.mark.parametrize("check, fitted, right, words, needs", FITTED, ids=lambda v: getattr(v, "__name__", ""))
def test_an_answer_fitted_to_the_notebook_passes_its_check_and_fails_the_grader_s_draw(
    comm, seed, seed_with, grading_seeds, check, fitted, right, words, needs
):
    check(fitted, timeout=SHORT)  # the notebook's own cases: it passes
    name = check.__name__.removeprefix("check_")
    value = grading_seeds[0] if needs is None else seed_with(needs, name, among=range(1000))
    seed(value)
    with pytest.raises(CheckFailed) as failed:
        check(fitted, timeout=SHORT)
    message = str(failed.value)
    for word in [*words, f"seed {value}"]:
        assert word in message, message


def bucketed(comm, arrays, cap_bytes, allreduce):
    """Lab 05's bucketed allreduce: arrays packed in order into buckets of at most cap_bytes, one call each."""
    buckets, used = [], math.inf
    for index, array in enumerate(arrays):
        if buckets and used + array.nbytes <= cap_bytes:
            buckets[-1].append(index)
            used += array.nbytes
        else:
            buckets.append([index])
            used = array.nbytes
    out = [None] * len(arrays)
    for bucket in buckets:
        summed = allreduce(comm, np.concatenate([arrays[i].ravel() for i in bucket]))
        start = 0
        for i in bucket:
            out[i] = summed[start : start + arrays[i].size].reshape(arrays[i].shape).copy()
            start += arrays[i].size
    return out


def scaling_efficiency(times, weak=False):
    return {p: times[1] / t if weak else times[1] / (p * t) for p, t in times.items()}


def lr_factor(step, k, rule="linear", warmup_steps=0):
    target = {"none": 1.0, "linear": float(k), "sqrt": k**0.5}[rule]
    return 1.0 + (target - 1.0) * step / warmup_steps if step < warmup_steps else target


RIGHT = [
    *[(check, right) for check, _, right, _, _ in FITTED],
    (check_ping_pong, unguarded(p2p.ping_pong)),
    (check_bcast_tree, unguarded(collectives.bcast_tree)),
    (check_reduce_linear, unguarded(collectives.reduce_linear)),
    (check_reduce_tree, unguarded(collectives.reduce_tree)),
    (check_broadcast_parameters, unguarded(broadcast_parameters)),
    (check_average_gradients, unguarded(average_gradients)),
    (check_allreduce_bucketed, bucketed),
]  # lab 03's other two: the solution graded on three seeds in tests/test_grading.py


@pytest.mark.parametrize("check, right", RIGHT, ids=lambda v: getattr(v, "__name__", ""))
def test_a_right_answer_passes_under_every_seed(comm, passes_on_every_seed, grading_seeds, check, right):
    # two seeds (lab 03's solution: three seeds in tests/test_grading.py); allreduce_ring's line goes on after its seed
    passes_on_every_seed(lambda: check(right), without=False, seeds=grading_seeds[:2], comm=comm, ending=False)


def test_the_checks_without_mpi_draw_too(seed, seed_with, grading_seeds):
    check_block_range(block_range_up_to_seven)
    check_fit_alpha_beta(unguarded(p2p.fit_alpha_beta))
    seed(seed_with(lambda draw: max(draw.lengths(5, 1, 64, "sizes")) > 7, "block_range", among=range(1000)))
    with pytest.raises(CheckFailed, match=r"size=\d+ ranks \(the grader's draw, seed \d+\): rank"):
        check_block_range(block_range_up_to_seven)
    for value in grading_seeds:
        seed(value)
        check_block_range(unguarded(block_range))
        check_fit_alpha_beta(unguarded(p2p.fit_alpha_beta))
        check_shard_indices(unguarded(shard_indices))
        check_scaling_efficiency(scaling_efficiency)
        check_lr_factor(lr_factor)


def test_lab_02_s_drawn_cases_keep_the_notebook_s_layouts_and_stay_exact(grading_seeds):
    from ddlab.checks.collectives import CASES, DRAWN_DTYPES, drawn_cases

    for value in grading_seeds:
        cases = drawn_cases(Draw(value, "bcast_tree"))
        assert [c.layout for c in cases] == [c.layout for c in CASES]
        assert {c.dtype for c in cases} <= set(DRAWN_DTYPES)
        for case in cases:
            xs = [case.make(rank) for rank in range(8)]
            assert xs[0].shape == case.shape and xs[0].dtype == np.dtype(case.dtype)
            exact = sum(x.astype(np.int64) for x in xs).astype(case.dtype)  # integers wrap: in any order alike
            assert np.array_equal(exact, sum(xs)), "sums are exact in the dtype, whatever the order"
    assert drawn_cases(Draw(1, "bcast_tree")) != drawn_cases(Draw(2, "bcast_tree"))


def test_lab_06_s_right_answers_pass_on_a_drawn_split(comm, seed, grading_seeds, capsys):
    from ddlab.checks import check_balanced_split, check_recv_tensor, check_send_tensor
    from ddlab.model_parallel import RecvTensor, SendTensor, balanced_split

    seed(grading_seeds[1])
    check_send_tensor(unguarded(SendTensor))
    check_recv_tensor(unguarded(RecvTensor))
    if comm.Get_rank() == 0:
        check_balanced_split(unguarded(balanced_split))
        said = capsys.readouterr().out
        assert said.count(f"seed {grading_seeds[1]}") == 3, said


def test_lab_07_s_right_answers_pass_on_drawn_schedules_and_ranks(comm, seed, grading_seeds, capsys):
    from ddlab.checks import check_gpipe, check_one_f_one_b, check_pipedream_partition, check_run_schedule
    from ddlab.pipeline import gpipe, one_f_one_b, pipedream_partition, run_schedule

    seed(grading_seeds[2])
    check_run_schedule(unguarded(run_schedule))
    check_gpipe(unguarded(gpipe))
    check_one_f_one_b(unguarded(one_f_one_b))
    check_pipedream_partition(unguarded(pipedream_partition))
    if comm.Get_rank() == 0:
        said = capsys.readouterr().out
        assert said.count(f"seed {grading_seeds[2]}") == 4, said


def test_lab_12_s_right_answers_pass_on_drawn_sizes_dtypes_and_ranks(comm, seed, grading_seeds, capsys):
    from ddlab.checks import check_exchange_plan, check_exchange_samples, check_redistribute
    from ddlab.shuffling.shuffler import exchange_plan, exchange_samples, redistribute

    seed(grading_seeds[0])
    check_exchange_plan(unguarded(exchange_plan))
    check_exchange_samples(unguarded(exchange_samples))
    check_redistribute(unguarded(redistribute))
    if comm.Get_rank() == 0:
        said = capsys.readouterr().out
        assert said.count(f"seed {grading_seeds[0]}") == 3, said
