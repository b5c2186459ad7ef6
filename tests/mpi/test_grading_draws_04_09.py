"""The grader's draw for lab 04's training checks (4.4 to 4.6): graded on cases the notebook never shows.

With DDLAB_GRADE_SEED set (as `ddlab grade --seed S` sets it in the kernel and its engines), check_train_step
and check_overlapped_averaging draw the ranks, the batch per rank, the steps, the rate, the seeds and 4.5's
buckets; check_trains_with_allreduce draws dtypes, vector lengths and data, the bucket cap and the batch. The
right answers pass under every seed and without one; each fitted answer below passes the notebook's check and
fails the grader's with the drawn case and the seed named. Lab 09's checks: tests/test_grading_draws_09.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab import data_parallel as dp
from ddlab.allreduce import allreduce_ring
from ddlab.checks import CheckFailed, check_overlapped_averaging, check_train_step, check_trains_with_allreduce
from ddlab.checks._draw import Draw
from ddlab.checks.data_parallel import drawn_training
from ddlab.models.mlp import make_mlp
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

#: Lab 04's checks train on the labs' 4 ranks, as their wrong-answer tests do (tests/test_mpi_suites.py); the
#: job on 3 ranks, which runs the library's tests, skips them (each check trains a few times: about 40 s here).
pytestmark = pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() != 4, reason="lab 04's checks are graded on the labs' 4 ranks"
)

SHORT = 3.0  # seconds a fitted answer may wait for a message that never comes

average_gradients = unguarded(dp.average_gradients)
ring = unguarded(allreduce_ring)


# The right answers --------------------------------------------------------------------------


def train_step(model, optimizer, x, y, comm, allreduce=None):
    """Exercise 4.4 as the lab solves it."""
    optimizer.zero_grad()
    loss = dp.squared_error(model(x), y).mean()
    loss.backward()
    average_gradients(model, comm, allreduce)
    optimizer.step()
    return loss.item()


def overlapped_averaging(model, comm, groups, buckets=None):
    """Exercise 4.5: one Iallreduce per group, started in group order from the hooks; `buckets` fixes their
    number (the fitted answer: the notebook's 4) instead of taking it from `groups`."""
    count = len(groups) if buckets is None else buckets
    owner = {p: k for k, group in enumerate(groups) for p in group}
    missing = [len(groups[k]) for k in range(count)]
    flats, requests, next_one = [None] * count, [None] * count, [0]

    def start_ready():
        while next_one[0] < count and missing[next_one[0]] == 0:
            k = next_one[0]
            flats[k] = torch.cat([p.grad.reshape(-1) for p in groups[k]]).numpy()
            requests[k] = comm.Iallreduce(MPI.IN_PLACE, flats[k])
            next_one[0] += 1

    def hook(p):
        missing[owner[p]] -= 1
        start_ready()

    for group in groups:
        for p in group:
            p.register_post_accumulate_grad_hook(hook)

    def finish():
        for k in range(count):
            requests[k].Wait()
            offset = 0
            for p in groups[k]:
                p.grad.copy_(torch.from_numpy(flats[k][offset : offset + p.numel()]).view_as(p) / comm.Get_size())
                offset += p.numel()
            missing[k] = len(groups[k])
        next_one[0] = 0

    return finish


RIGHT = [
    (check_train_step, train_step),
    (check_overlapped_averaging, overlapped_averaging),
    (check_trains_with_allreduce, ring),
]


@pytest.mark.parametrize("check, right", RIGHT, ids=lambda v: getattr(v, "__name__", ""))
def test_a_right_answer_passes_without_a_seed_and_under_every_seed(comm, passes_on_every_seed, check, right):
    passes_on_every_seed(lambda: check(right), comm=comm)


# Answers fitted to the notebook's cases -------------------------------------------------------


def step_for_a_batch_of_8(model, optimizer, x, y, comm, allreduce=None):
    """4.4 with the mean taken over the notebook's 8 samples per rank: a sum divided by 8."""
    optimizer.zero_grad()
    loss = dp.squared_error(model(x), y).sum() / 8
    loss.backward()
    average_gradients(model, comm, allreduce)
    optimizer.step()
    return loss.item()


def four_buckets(model, comm, groups):
    """4.5 with room for the 4 buckets the notebook's check makes of the lab MLP's float64 gradients."""
    return overlapped_averaging(model, comm, groups, buckets=4)


#: MPI datatypes of the three dtypes the notebook's check 4.6 prints, and no others.
MPI_TYPES = {np.dtype(np.float64): MPI.DOUBLE, np.dtype(np.float32): MPI.FLOAT, np.dtype(np.int64): MPI.INT64_T}


def ring_of_three_dtypes(comm, x):
    """4.6's allreduce naming the MPI datatype of each dtype the notebook's check ran."""
    MPI_TYPES[x.dtype]  # KeyError on any other dtype
    return ring(comm, x)


def buckets_of(draw: Draw) -> int:
    """How many buckets the grader's cap makes of the lab MLP's float64 gradients."""
    return len(dp.plan_buckets(list(make_mlp(dtype=torch.float64).parameters()), drawn_training(draw).cap_mb))


WHERE = "of the check's communicator, in that order"  # each_size names the drawn ranks
FITTED = [  # (check, the fitted answer, what the seed must draw, words the failure names besides the seed)
    (
        lambda fn: check_train_step(fn, timeout=SHORT),
        step_for_a_batch_of_8,
        "train_step",
        lambda draw: drawn_training(draw).per_rank != 8,
        lambda draw: ["train_step", f"batch {drawn_training(draw).per_rank} per rank", "data seed", WHERE],
    ),
    (
        lambda fn: check_overlapped_averaging(fn, timeout=SHORT),
        four_buckets,
        "overlapped_averaging",
        lambda draw: buckets_of(draw) != 4,
        lambda draw: ["overlapped_averaging", f"{buckets_of(draw)} buckets (cap", "per rank", "data seed", WHERE],
    ),
    (
        check_trains_with_allreduce,
        ring_of_three_dtypes,
        "trains_with_allreduce",
        lambda draw: True,  # every draw holds a dtype the notebook's check never runs
        lambda draw: ["KeyError", "elements in", "data seed", WHERE],
    ),
]


@pytest.mark.parametrize("check, fitted, name, needs, words", FITTED, ids=[f[2] for f in FITTED])
def test_an_answer_fitted_to_the_notebook_passes_its_check_and_fails_the_grader_s_draw(
    comm, seed, seed_with, check, fitted, name, needs, words
):
    check(fitted)  # the notebook's own cases: it passes
    value = seed_with(needs, name, among=range(1000))
    seed(value)
    with pytest.raises(CheckFailed) as failed:
        check(fitted)
    message = str(failed.value)
    for word in [*words(Draw(value, name)), f"(the grader's draw, seed {value})"]:
        assert word in message, message
