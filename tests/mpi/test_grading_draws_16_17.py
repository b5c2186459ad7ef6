"""The grader's draw for labs 16 and 17's checks (ddlab.checks._draw): graded on cases the notebook never shows.

With DDLAB_GRADE_SEED set, the checks of lab 16's mesh exercises (16.1 split_mesh, 16.2 the trainer, 16.3 the
interleaved schedule) and of lab 17 (17.1 the split backward, 17.2 ZB-H1, 17.3 the executor, 17.4 ZB-V) draw
their ranks and their order, sizes, shapes, micro-batches, layouts and data seeds. The library's answers pass
under every seed; each answer below is fitted to what the notebook's check runs: it passes the notebook's
check, and fails under the grader's draw with the drawn case and the seed named. (Without a seed, the library's
16.1, 17.1 and 17.2 pass here; the other four in the lab's own tests, and the notebook's cases of 16.3 and 17.3
in the fitted tests below, whose answers give the library's results there: see RIGHT. For time.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ddlab.checks import (
    CheckFailed,
    check_interleaved,
    check_mesh_trainer,
    check_run_zero_bubble,
    check_split_backward,
    check_split_mesh,
    check_zb_h1,
    check_zb_v,
)
from ddlab.checks.mesh import INTERLEAVED_SIZES
from ddlab.mesh import DIMS, MeshTrainer, split_mesh, validate_sizes
from ddlab.pipeline import interleaved_1f1b, micro_batch_loss
from ddlab.pipeline.zero_bubble import backward_input, backward_weight, forward_recorded, run_split, zb_h1, zb_v
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

# Labs 16 and 17 run on 4 engines (their checks' cases are the 4 ranks'); tests/test_mpi_suites.py's job on 3
# ranks is for the library's tests and the answers that must fold an odd rank count.
pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 4, reason="labs 16 and 17's checks run on 4 ranks")

SHORT = 3.0  # seconds a fitted answer may wait for a message that never comes

# The library's own answers without their mark: a check refuses them to an answer, these tests hand them in
# as the right answers, and build the fitted ones from them before any check runs.
split_mesh = unguarded(split_mesh)
interleaved_1f1b = unguarded(interleaved_1f1b)
backward_input, backward_weight = unguarded(backward_input), unguarded(backward_weight)
zb_h1, zb_v, run_split = unguarded(zb_h1), unguarded(zb_v), unguarded(run_split)
MeshTrainer = unguarded(MeshTrainer)


# The right answers --------------------------------------------------------------------


def run_zero_bubble(comm, layers, ops, inputs, targets):
    """17.3 by the library's executor of split ops (one chunk per rank)."""
    return run_split(comm, [layers], ops, inputs, targets)


def train_on_mesh(model, mesh, batch_at, steps, micro_batches=1, zero=0, sequence_parallel=False):
    """16.2 by the library's MeshTrainer, step by step."""
    trainer = MeshTrainer(model, mesh, zero=zero, sequence_parallel=sequence_parallel)
    try:
        return [trainer.step(*batch_at(step), micro_batches) for step in range(steps)]
    finally:
        trainer.close()


#: (check, the library's answer, whether it runs here without a seed too). Without a seed, the others run the
#: notebook's cases in the fitted tests below, whose answers give the library's results on those cases (a table of
#: its lists, its executor on the first P ranks), and in the lab's own tests: test_zero_bubble_checks.py
#: (ZB-V's greedy lists), test_mesh_trainer_checks.py (the interleaved schedule, the library's trainer). The
#: trainer's seeds: test_the_library_s_trainer_passes_under_every_seed.
RIGHT = [
    (check_split_mesh, (split_mesh,), True),
    (check_split_backward, (backward_input, backward_weight), True),
    (check_zb_h1, (zb_h1,), True),
    (check_interleaved, (interleaved_1f1b,), False),
    (check_run_zero_bubble, (run_zero_bubble,), False),
    (check_zb_v, (zb_v,), False),
]


@pytest.mark.parametrize("check, answer, without", RIGHT, ids=lambda v: getattr(v, "__name__", ""))
def test_the_library_s_answer_passes_under_every_seed(comm, passes_on_every_seed, check, answer, without):
    passes_on_every_seed(lambda: check(*answer), without=without, comm=comm)


def test_the_library_s_trainer_passes_under_every_seed(comm, passes_on_every_seed):
    """The first seed's draw for the check's 3 steps; the others' (their layouts, micro-batches, ZeRO stages, batches
    and rank orders) for 1 step each, for time: the steps are the check's argument, not drawn."""
    steps = iter((3, 1, 1))  # the check's steps under each grading seed, in order
    passes_on_every_seed(lambda: check_mesh_trainer(train_on_mesh, steps=next(steps)), without=False, comm=comm)


# Answers fitted to the notebook's cases --------------------------------------------------


def split_by_rank(comm, sizes, rank):
    """16.1's coordinates of `rank` and one Split per dimension (the notebook's solution, given the rank)."""
    coords = {}
    for name in reversed(DIMS):
        rank, coords[name] = divmod(rank, sizes[name])
    comms = {}
    for name in DIMS:
        colour = 0
        for other in DIMS:
            if other != name:
                colour = colour * sizes[other] + coords[other]
        comms[name] = comm.Split(colour, coords[name])
    return {name: coords[name] for name in DIMS}, comms


def split_mesh_by_the_world_s_rank(comm, sizes):
    """16.1 with each coordinate read off the world's rank: right on the first P ranks, the notebook's."""
    validate_sizes(sizes, comm.Get_size())
    return split_by_rank(comm, sizes, MPI.COMM_WORLD.Get_rank())


def split_mesh_refusing_only_too_many_ranks(comm, sizes):
    """16.1 refusing sizes whose product passes the ranks, as the notebook's one wrong case (P + 1) does."""
    if math.prod(sizes.values()) > comm.Get_size():
        raise ValueError(f"sizes {sizes} need more than the {comm.Get_size()} ranks")
    return split_by_rank(comm, sizes, comm.Get_rank())


#: 16.3's and 17.2's lists for the sizes the notebook's checks try, kept by a student who tabled them.
INTERLEAVED_TABLE = {(p, v, m): [interleaved_1f1b(p, m, r, v) for r in range(p)] for p, v, m in INTERLEAVED_SIZES}
ZB_H1_TABLE = {(p, m): [zb_h1(p, m, s) for s in range(p)] for p in range(1, 6) for m in range(1, 11)}


def interleaved_from_a_table(p, m, rank, v):
    if v > 1 and m % p:
        raise ValueError(f"m = {m} micro-batches must be a multiple of p = {p}")
    return INTERLEAVED_TABLE[(p, v, m)][rank]


def zb_h1_from_a_table(p, m, stage):
    return ZB_H1_TABLE[(p, m)][stage]


def weight_by_axis_1(pending):
    """17.1's W reshaping to rows x shape[1]: the same axis as the last one on the notebook's (2, 3, 3) only."""
    for layer, a, g in pending:
        a2, g2 = a.reshape(-1, a.shape[1]), g.reshape(-1, g.shape[1])
        layer.weight.grad = layer.weight.grad + g2.T @ a2
        if layer.bias is not None:
            layer.bias.grad = layer.bias.grad + g2.sum(0)


def run_zero_bubble_by_the_world_s_rank(comm, layers, ops, inputs, targets):
    """17.3 with the notebook's `rank` (the world's) for its stage: right on the first P ranks only."""
    me, size = MPI.COMM_WORLD.Get_rank(), comm.Get_size()
    first, last = me == 0, me == size - 1
    sends, kept, waiting, losses = [], {}, {}, {}

    def take(source, tag):
        buf = np.empty(tuple(inputs[0].shape), np.float64)
        comm.Recv(buf, source, tag)
        return torch.from_numpy(buf)

    def post(tensor, dest, tag):
        buf = tensor.detach().numpy().copy()
        sends.append((comm.Isend(buf, dest, tag), buf))

    for kind, i in ops:
        if kind == "F":
            x = inputs[i] if first else take(me - 1, i).requires_grad_()
            y, records = forward_recorded(layers, x)
            if last:
                y = micro_batch_loss(y, targets[i])
                losses[i] = y.item()
            else:
                post(y, me + 1, i)
            kept[i] = (x, y, records)
        elif kind == "B":
            x, y, records = kept.pop(i)
            grad_x, waiting[i] = backward_input(y, None if last else take(me + 1, i), x, records)
            if not first:
                post(grad_x, me - 1, i)
        else:
            backward_weight(waiting.pop(i))
    MPI.Request.Waitall([request for request, _ in sends])
    return [losses[i] for i in sorted(losses)]


FITTED = [  # (check, the fitted answer, words its failure under the draw names besides the seed)
    (check_split_mesh, (split_mesh_by_the_world_s_rank,), ["coords are", "of the check's communicator, in that order"]),
    (check_split_mesh, (split_mesh_refusing_only_too_many_ranks,), ["accepted sizes", "raise ValueError"]),
    (check_interleaved, (interleaved_from_a_table,), ["KeyError", "micro-batches"]),
    (check_split_backward, (backward_input, weight_by_axis_1), ["3-D activations", "weights and data of seed"]),
    (check_zb_h1, (zb_h1_from_a_table,), ["KeyError", "zb_h1(p="]),
    (
        check_run_zero_bubble,
        (run_zero_bubble_by_the_world_s_rank,),
        ["micro-batches of", "of the check's communicator, in that order"],
    ),
]


@pytest.mark.parametrize("check, answer, words", FITTED, ids=lambda v: getattr(v, "__name__", ""))
def test_an_answer_fitted_to_the_notebook_passes_its_check_and_fails_the_grader_s_draw(
    comm, seed, grading_seeds, check, answer, words
):
    timeout = {"timeout": SHORT} if check in (check_split_mesh, check_run_zero_bubble) else {}
    check(*answer, **timeout)  # the notebook's own cases: it passes
    seed(grading_seeds[0])
    with pytest.raises(CheckFailed) as failed:
        check(*answer, **timeout)
    message = str(failed.value)
    for word in [*words, f"seed {grading_seeds[0]}"]:
        assert word in message, message
    assert len(set(comm.allgather(message))) == 1, "the ranks agree on the failure"
