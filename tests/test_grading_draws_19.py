"""Lab 19's checks graded on the grader's draw (ddlab.checks._draw): which ranks die, when, and on what.

The checks run fault-tolerant jobs of their own (one process here, as tests/test_resilience_checks.py). The library's
answers pass under the seeds (and without one); answers fitted to the notebook's cases (rank 0 the one that dies; with
DDLAB_DRAWS=all also a timeout of its 1 s and a batch its 4 and 3 ranks divide) pass its check and fail a drawn case,
named with the seed.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from ddlab import checks, resilience
from ddlab.checks import CheckFailed
from ddlab.checks._draw import Draw
from ddlab.checks.resilience import _detect_plan, _goodput_cases, _rebuild_cases, _recover_cases, _train_cases
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

EXERCISES = ("detect", "recover", "train_resilient", "rebuild_shards", "simulate_goodput")
#: Every job costs seconds (4 ranks started, one SIGKILLed): by default each check that runs jobs is graded on one of
#: the grading seeds (a different one each), the notebook's cases are left to the notebook and tests/test_resilience_checks.py,
#: and one fitted answer is tried; DDLAB_DRAWS=all runs every check without a seed and on all three, and the three
#: fitted answers (2:27, 137 s of calls, under a load average of about 30 on 2 cores).
EVERY_SEED = os.environ.get("DDLAB_DRAWS") == "all"


def seeds_of(exercise: str, seeds: tuple[int, ...]) -> tuple[bool, tuple[int, ...]]:
    """Whether the library's answer to `exercise` is graded on the notebook's cases too, and on which of `seeds`."""
    if EVERY_SEED or exercise == "simulate_goodput":  # no job: every seed costs milliseconds
        return True, seeds
    return False, (seeds[EXERCISES.index(exercise) % len(seeds)],)


@pytest.mark.parametrize("exercise", EXERCISES)
def test_the_library_s_answer_passes_under_the_grader_s_draws(passes_on_every_seed, grading_seeds, exercise):
    check, right = getattr(checks, f"check_{exercise}"), unguarded(getattr(resilience, exercise))
    without, seeds = seeds_of(exercise, grading_seeds)
    passes_on_every_seed(lambda: check(right), without=without, seeds=seeds)


# Answers fitted to the notebook's cases ------------------------------------------------


def detect_within_one_second(comm, source, timeout):
    """19.1 waiting the notebook's 1 s whatever `timeout` says."""
    request = comm.Irecv(np.empty(8), source=source, tag=MPI.ANY_TAG)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        try:
            if request.Test():
                return "arrived"
        except MPI.Exception:
            return "dead"
        time.sleep(1e-3)
    request.Cancel()
    request.Wait()
    return "slow"


def train_with_equal_shares(comm, problem, steps):
    """19.3 giving each rank batch // P samples: all of them for the notebook's batch of 12 on 4 and 3 ranks."""
    params, losses, step = problem.initial(), [], 0
    while step < steps:
        share = problem.batch // comm.Get_size()
        ids = problem.batch_ids(step)[comm.Get_rank() * share : (comm.Get_rank() + 1) * share]
        ok, total = 1, np.zeros(1 + params.size)
        try:
            loss, grad = problem.loss_and_grad(params, ids)
            comm.Allreduce(np.concatenate(([loss], grad)), total)
        except MPI.Exception:
            ok = 0
            comm.Revoke()
        try:
            ok = comm.Agree(ok)
        except MPI.Exception:
            ok = 0
        if not ok:
            comm, step = resilience.recover(comm, step)
            del losses[step:]
            continue
        params = params - problem.lr * total[1:] / problem.batch
        losses.append(total[0] / problem.batch)
        step += 1
    return losses


def rebuild_after_rank_0(comm, old_rank, old_size, mine, buddy, numel):
    """19.4 taking the dead rank to be 0, the notebook's: its shard from the last old rank's buddy copy."""
    shards = [None] * old_size
    for q, own, copy in comm.allgather((old_rank, mine, buddy)):
        shards[q] = own
        if q == old_size - 1:
            shards[0] = copy
    shards = [np.zeros_like(mine) if s is None else s for s in shards]
    return resilience.reshard(shards, numel, comm.Get_size(), comm.Get_rank())


FITTED = [  # (exercise, the fitted answer, words the failure names beside the seed, what the seed must draw)
    ("rebuild_shards", rebuild_after_rank_0, ["the buddy copy", "values of seed"], lambda d: _rebuild_cases(d)[1] != 0),
]
if EVERY_SEED:  # 5 jobs, about 33 s
    FITTED += [
        (  # a timeout of 1.5 s or more: the 1 s answer returns 0.35 s before the 0.9 T the check allows, even late
            "detect",
            detect_within_one_second,
            ["(slow): returned after", "with a timeout of"],
            lambda draw: _detect_plan(draw).timeout >= 1.5,
        ),
        ("train_resilient", train_with_equal_shares, ["never used by the survivors", "a batch of"], None),
    ]


@pytest.mark.parametrize("exercise, fitted, words, needs", FITTED, ids=lambda v: getattr(v, "__name__", str(v)))
def test_an_answer_fitted_to_the_notebook_passes_its_check_and_fails_the_grader_s_draw(
    seed, seed_with, exercise, fitted, words, needs
):
    check = getattr(checks, f"check_{exercise}")
    check(fitted)  # the notebook's own cases: it passes
    value = seed_with(needs, exercise)
    seed(value)
    with pytest.raises(CheckFailed) as failed:
        check(fitted)
    message = str(failed.value)
    for word in [*words, f"(the grader's draw, seed {value})"]:
        assert word in message, message


def test_the_drawn_cases_stay_in_the_lab_s_domain(grading_seeds):
    """The draw keeps what 19.2-19.5's texts and the checks' bookkeeping need: the second victim's `done` the
    smallest (only a retry finds the answer), an epoch of at least the steps, kills inside the run, a goodput
    case without failures and one whose work is not a multiple of the interval."""
    for value in grading_seeds:
        for _, second, done in _recover_cases(4, Draw(value, "recover"))[1:]:
            assert second is not None and done[second] < min(d for r, d in done.items() if r != second)
        for case in _train_cases(4, Draw(value, "train_resilient")):
            assert case.problem.samples // case.problem.batch >= case.steps and case.problem.batch % 12
            assert all(2 <= f.call < case.steps for f in case.failures)
            assert all(plan.get("kill_at", 2) <= case.steps - 2 for plan in case.stage.values())
        ranks, victim, buffers, _ = _rebuild_cases(Draw(value, "rebuild_shards"))
        assert ranks in (3, 4) and 0 <= victim < ranks and all(1 <= n <= 40 for n, _ in buffers)
        cases = _goodput_cases(Draw(value, "simulate_goodput"))
        assert cases[0][0][2] == 1e12 and cases[3][0][4] % cases[3][0][0] != 0
