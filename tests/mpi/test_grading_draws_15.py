"""Lab 15's checks graded on cases the notebook never shows (ddlab.checks._draw).

With DDLAB_GRADE_SEED set (as `ddlab grade --seed S` sets it in the kernel and its engines), every check
of lab 15 draws its ranks, lengths, shapes, heads, dtypes, experts, k, capacity factors and data. The
library's answers pass under every seed and without one; each answer below is fitted to what the
notebook's check runs (the world's rank where the communicator's is meant, a head width of 3, the three
dtypes the notebook shows, round() where the capacity is a ceiling): it passes the notebook's check and
fails under the grader's draw, with the drawn case and the seed named. (The backward ring draws its ranks
as the forward does, through the same each_size: its world-rank answer is the forward's case, not run
again here for the test time.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ddlab.checks import (
    CheckFailed,
    check_combine,
    check_dispatch,
    check_merge_partials,
    check_ring_attention,
    check_ring_attention_backward,
    check_route,
    check_ulysses,
    check_zigzag,
)
from ddlab.checks._draw import Draw
from ddlab.checks.context_parallel import ulysses_cases
from ddlab.checks.experts import drawn_cases, route_cases
from ddlab.context_parallel import (
    attend_block,
    empty_partial,
    finish,
    merge_partials,
    put_rows,
    reference_attention,
    ring_attention,
    ring_attention_backward,
    take_rows,
    ulysses_attention,
    zigzag_positions,
)
from ddlab.experts import Routing, combine, dispatch, route
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

#: tests/test_mpi_suites.py runs this folder on 4 ranks and its library tests again on 3; like the checks'
#: tests (test_*_checks.py), these grade lab 15's checks on the labs' 4 ranks only (they pass on 3 as well,
#: at twice the test time).
pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 4, reason="lab 15's checks graded on the labs' 4 ranks")

SHORT = 3.0  # seconds a fitted answer may wait for a message that never comes

positions_of = unguarded(zigzag_positions)


def merge(o1, m1, l1, o2, m2, l2):
    """The library's merge, with the exercise's signature."""
    return unguarded(merge_partials)((o1, m1, l1), (o2, m2, l2))


def zigzag_split(x, size, rank):
    """The library's split: rank's rows of the zero-padded sequence."""
    return take_rows(x, positions_of(x.shape[-2], size, rank))


def zigzag_unsplit(parts, length):
    """The library's un-split: every rank's rows back at their positions, padding dropped."""
    return put_rows(parts, np.stack([positions_of(length, len(parts), r) for r in range(len(parts))]), length)


RIGHT = [  # (check, the library's answer, the other arguments)
    (check_merge_partials, merge, ()),
    (check_ring_attention, unguarded(ring_attention), ()),
    (check_ring_attention_backward, unguarded(ring_attention_backward), ()),
    (check_ulysses, unguarded(ulysses_attention), ()),
    (check_zigzag, zigzag_split, (zigzag_unsplit,)),
    (check_dispatch, unguarded(dispatch), ()),
    (check_combine, unguarded(combine), ()),
    (check_route, unguarded(route), ()),
]


@pytest.mark.parametrize("check, right, others", RIGHT, ids=lambda v: getattr(v, "__name__", ""))
def test_the_library_s_answer_passes_without_a_seed_and_under_every_seed(
    comm, passes_on_every_seed, check, right, others
):
    passes_on_every_seed(lambda: check(right, *others), comm=comm)


# Answers fitted to the notebook's cases ------------------------------------------------

TAG = 15


def ring_by_world_rank(comm, q, k, v, positions):
    """Lab 15.2's ring numbering ranks by the world's rank: right on the whole world and its first P ranks only."""
    rank, size = MPI.COMM_WORLD.Get_rank(), comm.Get_size()
    merge = unguarded(merge_partials)
    held = np.stack([k, v])
    partial = empty_partial(q, v.shape[-1])
    for step in range(size):
        source = (rank - step) % size
        if step < size - 1:
            incoming = np.empty_like(held)
            comm.Sendrecv(held, (rank + 1) % size, TAG, incoming, (rank - 1) % size, TAG)
        partial = merge(partial, attend_block(q, held[0], held[1], positions[rank], positions[source]))
        if step < size - 1:
            held = incoming
    return finish(partial)


def ulysses_of_width_3(comm, q, k, v, positions):
    """Lab 15.5's Ulysses with the notebook's head width (3) written in: the output reshaped to (H, n, 3)."""
    size = comm.Get_size()
    heads, rows = q.shape[:2]

    def to_heads(x):
        outgoing = np.ascontiguousarray(x.reshape(size, heads // size, rows, 3))
        incoming = np.empty_like(outgoing)
        comm.Alltoall(outgoing, incoming)
        return np.concatenate(list(incoming), axis=-2)

    whole = positions.reshape(-1)
    out, _ = reference_attention(to_heads(q), to_heads(k), to_heads(v), whole, whole)
    outgoing = np.ascontiguousarray(np.stack(np.split(out, size, axis=-2)))
    incoming = np.empty_like(outgoing)
    comm.Alltoall(outgoing, incoming)
    return incoming.reshape(heads, rows, 3)


#: MPI datatypes of the three dtypes the notebook's dispatch and combine checks show, and no others.
MPI_TYPES = {np.dtype(np.float64): MPI.DOUBLE, np.dtype(np.float32): MPI.FLOAT, np.dtype(np.int64): MPI.INT64_T}


def _rows_by_alltoallv(comm, rows, send_rows, recv_rows):
    """One Alltoallv of whole rows, counted in elements of the MPI datatype of the rows' dtype."""
    width = int(np.prod(rows.shape[1:], dtype=np.int64))
    kind = MPI_TYPES[rows.dtype]  # KeyError on a dtype the notebook never shows
    out, into = np.asarray(send_rows, np.int64) * width, np.asarray(recv_rows, np.int64) * width
    incoming = np.empty((int(sum(recv_rows)), *rows.shape[1:]), dtype=rows.dtype)
    displs = [np.concatenate([[0], np.cumsum(c)[:-1]]).astype(np.int64) for c in (out, into)]
    comm.Alltoallv([np.ascontiguousarray(rows), out, displs[0], kind], [incoming, into, displs[1], kind])
    return incoming


def dispatch_of_three_dtypes(comm, x, expert, n_experts):
    """Lab 15.7's dispatch naming the MPI datatype of each dtype the notebook's check ran."""
    size = comm.Get_size()
    counts = np.bincount(expert, minlength=n_experts).astype(np.int64).reshape(size, -1)
    received = np.empty_like(counts)
    comm.Alltoall(counts, received)
    order = np.argsort(expert, kind="stable")
    return _rows_by_alltoallv(comm, x[order], counts.sum(1), received.sum(1)), received


def combine_of_three_dtypes(comm, y, counts, expert, n_experts):
    """Lab 15.8's combine naming the MPI datatype of each dtype the notebook's check ran."""
    order = np.argsort(expert, kind="stable")
    sent = np.bincount(expert, minlength=n_experts).reshape(comm.Get_size(), -1).sum(1)
    back = _rows_by_alltoallv(comm, y, counts.sum(1), sent)
    out = np.empty_like(back)
    out[order] = back
    return out


route_ = unguarded(route)


def route_with_round(logits, k, capacity_factor):
    """Lab 15.6's router whose capacity is rounded, not rounded up: the notebook's capacities are whole or .75."""
    tokens, experts = logits.shape
    routing = route_(logits, k, capacity_factor)
    limit = round(capacity_factor * k * tokens / experts)
    if limit >= routing.capacity:
        return routing
    probs = torch.softmax(logits, dim=-1)
    top, chosen = probs.topk(k, dim=-1)
    weight = (top / top.sum(-1, keepdim=True) if k > 1 else top).t().reshape(-1)
    expert, token = chosen.t().reshape(-1), torch.arange(tokens).repeat(k)
    one_hot = torch.nn.functional.one_hot(expert, experts)
    kept = (one_hot.cumsum(0) * one_hot).sum(1) - 1 < limit
    return Routing(
        token=token[kept],
        expert=expert[kept],
        weight=weight[kept],
        dropped=int((~kept).sum()),
        capacity=limit,
        load=routing.load,
        aux_loss=routing.aux_loss,
    )


def _first_ranks_only(draw: Draw, size: int) -> bool:
    """True if the draw's sub-communicators are all the first P ranks in order (a world-rank answer passes)."""
    return all(draw.ranks(size, p) == list(range(p)) for p in range(2, size + 1))


FITTED = [  # (check, the fitted answer, words the failure names, what the seed must draw, or None)
    (
        check_ring_attention,
        ring_by_world_rank,
        ["ring attention", "positions of shape", "data seed", "of the check's communicator"],
        lambda draw, size: not _first_ranks_only(draw, size),
    ),
    (
        check_ulysses,
        ulysses_of_width_3,
        ["Ulysses", "positions of width", "data seed"],
        lambda draw, size: any(case[2] != 3 for case in ulysses_cases(size, draw)),
    ),
    (check_dispatch, dispatch_of_three_dtypes, ["KeyError", "of shape", "data seed"], None),
    (check_combine, combine_of_three_dtypes, ["KeyError", "of shape", "data seed"], None),
    (
        check_route,
        route_with_round,
        ["capacity is", "capacity factor", "logits of seed"],
        lambda draw, size: any(
            round(f * k * t / e) != math.ceil(f * k * t / e) for t, e, k, f, _, _ in route_cases(draw)
        ),
    ),
]


@pytest.mark.parametrize("check, fitted, words, needs", FITTED, ids=lambda v: getattr(v, "__name__", ""))
def test_an_answer_fitted_to_the_notebook_passes_its_check_and_fails_the_grader_s_draw(
    comm, seed, seed_with, check, fitted, words, needs
):
    size = comm.Get_size()
    if size < 2 and check is not check_route:
        pytest.skip("one rank: no other rank to number wrongly, no message to type")
    timeout = {} if check is check_route else {"timeout": SHORT}
    check(fitted, **timeout)  # the notebook's own cases: it passes
    name = check.__name__.removeprefix("check_")
    value = seed_with(None if needs is None else lambda draw: needs(draw, size), name)
    seed(value)
    with pytest.raises(CheckFailed) as failed:
        check(fitted, **timeout)
    message = str(failed.value)
    for word in [*words, f"(the grader's draw, seed {value})"]:
        assert word in message, message


def test_dispatch_s_draw_shows_a_dtype_the_notebook_never_does_and_keeps_experts_a_multiple_of_p(grading_seeds):
    for value in grading_seeds:
        cases = drawn_cases(Draw(value, "dispatch"))
        assert any(np.dtype(case[0]) not in MPI_TYPES for case in cases)
        assert all(case[2] >= 1 for case in cases), "experts per rank: E a multiple of P"
        assert sum(case[4] for case in cases) == 1, "one case with a rank of no rows"
    assert drawn_cases(Draw(1, "dispatch")) != drawn_cases(Draw(2, "dispatch"))
