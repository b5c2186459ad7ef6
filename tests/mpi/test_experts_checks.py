"""Lab 15's dispatch and combine checks fail the plausible wrong answers on every rank, without hanging,
and accept valid answers written differently. Every rank runs the same tests."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest
import torch
from ddlab.checks import CheckFailed, check_combine, check_dispatch, check_route
from ddlab.experts import Routing, combine, dispatch, route
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
combine = unguarded(combine)
dispatch = unguarded(dispatch)
route = unguarded(route)


def _displacements(counts):
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def _send_rows(comm, rows, send_rows, recv_rows, dtype=None):
    """One Alltoallv of whole rows, receiving into a buffer of `dtype` (default the rows')."""
    width = int(np.prod(rows.shape[1:], dtype=np.int64))
    incoming = np.empty((int(sum(recv_rows)), *rows.shape[1:]), dtype=dtype or rows.dtype)
    out, into = np.asarray(send_rows, np.int64) * width, np.asarray(recv_rows, np.int64) * width
    comm.Alltoallv([np.ascontiguousarray(rows), (out, _displacements(out))], [incoming, (into, _displacements(into))])
    return incoming


def dispatch_by_buckets(comm, x, expert, n_experts):
    """Valid: a bucket per expert instead of a sort; counts sent as a flat array built in a loop."""
    size = comm.Get_size()
    local = n_experts // size
    buckets = [np.flatnonzero(expert == e) for e in range(n_experts)]
    counts = np.array([len(b) for b in buckets], dtype=np.int64)
    received = np.zeros(n_experts, dtype=np.int64)
    comm.Alltoall(counts, received)
    received = received.reshape(size, local)
    rows = _send_rows(comm, x[np.concatenate(buckets)], counts.reshape(size, local).sum(1), received.sum(1))
    return rows, received


def dispatch_counts_after_rows(comm, x, expert, n_experts):
    """Sends the rows first, guessing it receives as many as it sends, and only then exchanges the counts."""
    size = comm.Get_size()
    counts = np.bincount(expert, minlength=n_experts).astype(np.int64).reshape(size, -1)
    order = np.argsort(expert, kind="stable")
    guess = [int(counts.sum()) // size] * size
    rows = _send_rows(comm, x[order], counts.sum(1), guess)
    received = np.empty_like(counts)
    comm.Alltoall(counts, received)
    return rows, received


def dispatch_into_float64(comm, x, expert, n_experts):
    """Receives into a float64 buffer whatever the rows' dtype."""
    size = comm.Get_size()
    counts = np.bincount(expert, minlength=n_experts).astype(np.int64).reshape(size, -1)
    received = np.empty_like(counts)
    comm.Alltoall(counts, received)
    order = np.argsort(expert, kind="stable")
    return _send_rows(comm, x[order], counts.sum(1), received.sum(1), np.float64), received


def dispatch_unstable(comm, x, expert, n_experts):
    """Sorts by expert with an unstable sort: rows of one expert leave out of the sender's order."""
    size = comm.Get_size()
    counts = np.bincount(expert, minlength=n_experts).astype(np.int64).reshape(size, -1)
    received = np.empty_like(counts)
    comm.Alltoall(counts, received)
    order = np.lexsort((-np.arange(len(expert)), expert))  # ties reversed
    return _send_rows(comm, x[order], counts.sum(1), received.sum(1)), received


def dispatch_skipping_when_empty(comm, x, expert, n_experts):
    """Returns at once when this rank has no rows: the others wait for it in the Alltoall."""
    if len(x) == 0:
        return x.copy(), np.zeros((comm.Get_size(), n_experts // comm.Get_size()), dtype=np.int64)
    return dispatch(comm, x, expert, n_experts)


def combine_in_arrival_order(comm, y, counts, expert, n_experts):
    """Sends the results back but keeps them in the order they arrived (sorted by expert)."""
    size = comm.Get_size()
    sent = np.bincount(expert, minlength=n_experts).reshape(size, -1).sum(1)
    return _send_rows(comm, y, counts.sum(1), sent)


def combine_by_inverse_index(comm, y, counts, expert, n_experts):
    """Valid: buckets again, and the inverse permutation applied as a gather by its inverse index."""
    size = comm.Get_size()
    order = np.concatenate([np.flatnonzero(expert == e) for e in range(n_experts)]).astype(np.int64)
    back = _send_rows(comm, y, counts.sum(1), np.bincount(expert, minlength=n_experts).reshape(size, -1).sum(1))
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return back[inverse]


def combine_into_float64(comm, y, counts, expert, n_experts):
    """Receives the results back into a float64 buffer whatever their dtype."""
    size = comm.Get_size()
    order = np.argsort(expert, kind="stable")
    sent = np.bincount(expert, minlength=n_experts).reshape(size, -1).sum(1)
    back = _send_rows(comm, y, counts.sum(1), sent, np.float64)
    out = np.empty_like(back)
    out[order] = back
    return out


def combine_in_place(comm, y, counts, expert, n_experts):
    """Writes the results into y and returns it: y is the caller's."""
    out = combine(comm, y, counts, expert, n_experts)
    y[: len(out)] = out[: len(y)]
    return out


@pytest.mark.parametrize("answer", [dispatch, dispatch_by_buckets])
def test_dispatch_check_accepts_valid_answers(comm, answer):
    check_dispatch(answer)


@pytest.mark.parametrize(
    "answer, says",
    [
        (dispatch_counts_after_rows, "counts first|Alltoallv"),
        (dispatch_into_float64, "dtype|bytes"),
        (dispatch_unstable, "rows received is wrong"),
    ],
)
def test_dispatch_check_fails_wrong_answers(comm, answer, says):
    with pytest.raises(CheckFailed, match=says):
        check_dispatch(answer)


def test_dispatch_check_fails_a_rank_that_skips_the_exchange_within_its_timeout(comm):
    with pytest.raises(CheckFailed, match="Alltoall"):
        check_dispatch(dispatch_skipping_when_empty, timeout=2)


@pytest.mark.parametrize("answer", [combine, combine_by_inverse_index])
def test_combine_check_accepts_valid_answers(comm, answer):
    check_combine(answer)


@pytest.mark.parametrize(
    "answer, says",
    [(combine_in_arrival_order, "row i"), (combine_in_place, "changed y|view"), (combine_into_float64, "dtype|bytes")],
)
def test_combine_check_fails_wrong_answers(comm, answer, says):
    with pytest.raises(CheckFailed, match=says):
        check_combine(answer)


def _combine_with_order(comm, y, counts, expert, n_experts, order):
    """One Alltoallv back, then position i of what came back put at row order[i]."""
    size = comm.Get_size()
    sent = np.bincount(expert, minlength=n_experts).reshape(size, -1).sum(1)
    back = _send_rows(comm, y, counts.sum(1), sent)
    out = np.empty_like(back)
    out[order] = back
    return out


def combine_by_default_argsort(comm, y, counts, expert, n_experts):
    """Takes the rows' order from np.argsort's default sort, which need not keep ties in the sender's order."""
    return _combine_with_order(comm, y, counts, expert, n_experts, np.argsort(expert))


def combine_reversed_on_later_ranks(comm, y, counts, expert, n_experts):
    """Rank 0 puts its rows back right, the others put the rows of one expert back in reverse order:
    the ranks disagree on whether the first case failed."""
    ties = np.arange(len(expert)) * (1 if comm.Get_rank() == 0 else -1)
    return _combine_with_order(comm, y, counts, expert, n_experts, np.lexsort((ties, expert)))


def dispatch_without_minlength(comm, x, expert, n_experts):
    """Counts from np.bincount(expert) without minlength, padded to whole ranks: their length, and so the
    Alltoall's blocks, differ from rank to rank."""
    size = comm.Get_size()
    counts = np.bincount(expert).astype(np.int64)
    counts = np.pad(counts, (0, -len(counts) % size)).reshape(size, -1)
    received = np.empty_like(counts)
    comm.Alltoall(counts, received)
    order = np.argsort(expert, kind="stable")
    return _send_rows(comm, x[order], counts.sum(1), received.sum(1)), received


def dispatch_counts_twice(comm, x, expert, n_experts):
    """Exchanges the counts, then exchanges them again (as if to check): one Alltoall too many."""
    size = comm.Get_size()
    counts = np.bincount(expert, minlength=n_experts).astype(np.int64).reshape(size, -1)
    received = np.empty_like(counts)
    comm.Alltoall(counts, received)
    comm.Alltoall(counts, received)
    order = np.argsort(expert, kind="stable")
    return _send_rows(comm, x[order], counts.sum(1), received.sum(1)), received


@pytest.mark.parametrize("answer", [combine_by_default_argsort, combine_reversed_on_later_ranks])
def test_combine_check_fails_rows_put_back_in_another_order_without_hanging(comm, deadline, answer):
    """Rows of one expert put back in another order than they left: a message within a minute, on every rank."""
    with deadline(60), pytest.raises(CheckFailed, match="row i"):
        check_combine(answer, timeout=5)


@pytest.mark.parametrize(
    "answer, says",
    [(dispatch_without_minlength, "buffers disagree"), (dispatch_counts_twice, "Alltoall then Alltoall")],
)
def test_dispatch_check_fails_counts_that_disagree_or_travel_twice_with_a_message(comm, deadline, answer, says):
    with deadline(60), pytest.raises(CheckFailed, match=says):
        check_dispatch(answer, timeout=5)


def dispatch_on_the_world(comm, x, expert, n_experts):
    """Valid steps, but on the notebook's MPI.COMM_WORLD instead of the communicator given."""
    from mpi4py import MPI

    return dispatch(MPI.COMM_WORLD, x, expert, n_experts)


def combine_on_the_world(comm, y, counts, expert, n_experts):
    """Valid steps, but on the notebook's MPI.COMM_WORLD instead of the communicator given."""
    from mpi4py import MPI

    return combine(MPI.COMM_WORLD, y, counts, expert, n_experts)


def test_checks_fail_answers_on_the_global_communicator_with_a_message(comm, deadline):
    with deadline(60), pytest.raises(CheckFailed, match="no collective"):
        check_dispatch(dispatch_on_the_world, timeout=5)
    with deadline(60), pytest.raises(CheckFailed, match="no collective"):
        check_combine(combine_on_the_world, timeout=5)


# --- the router (exercise 15.6) ------------------------------------------------------------------------------


def router_with(capacity_k=True, served="choice", renormalise=True, loss="switch"):
    """A router; the variations are wrong answers: capacity_k=False leaves k out of the capacity, served="token"
    serves a token's both choices before the next token's, renormalise=False keeps the raw top-2 probabilities,
    loss="max" uses each expert's largest probability for P_i."""

    def answer(logits, k, capacity_factor):
        tokens, experts = logits.shape
        probs = torch.softmax(logits, dim=-1)
        top, chosen = probs.topk(k, dim=-1)
        weight = top / top.sum(-1, keepdim=True) if k > 1 and renormalise else top
        limit = math.ceil(capacity_factor * (k if capacity_k else 1) * tokens / experts)
        if served == "choice":
            expert, token, weight = chosen.t().reshape(-1), torch.arange(tokens).repeat(k), weight.t().reshape(-1)
        else:
            expert, token, weight = chosen.reshape(-1), torch.arange(tokens).repeat_interleave(k), weight.reshape(-1)
        one_hot = torch.nn.functional.one_hot(expert, experts)
        slot = (one_hot.cumsum(0) * one_hot).sum(1) - 1  # place in its expert's queue, by a running count
        kept = slot < limit
        fraction = torch.bincount(chosen[:, 0], minlength=experts).to(probs.dtype) / tokens
        share = probs.mean(0) if loss == "switch" else probs.max(0).values
        return Routing(
            token=token[kept],
            expert=expert[kept],
            weight=weight[kept],
            dropped=int((~kept).sum()),
            capacity=limit,
            load=torch.bincount(expert, minlength=experts),
            aux_loss=experts * torch.sum(fraction * share),
        )

    return answer


def route_softmax_of_the_top_two(logits, k, capacity_factor):
    """GShard's renormalised top-2 gates as a softmax of the two top logits: the same values, and a gradient by
    the other logits that is exactly 0 where the library's is a rounding residue."""
    got = route(logits, k, capacity_factor)
    if k != 2:
        return got
    top = logits.topk(2, dim=-1).values
    weight = torch.exp(logits[got.token, got.expert] - torch.logsumexp(top[got.token], dim=-1))
    return dataclasses.replace(got, weight=weight)


def test_route_check_accepts_the_library_and_a_running_count(comm):
    check_route(route)
    check_route(router_with())
    check_route(route_softmax_of_the_top_two)


def route_stuck_on_the_last_rank(logits, k, capacity_factor):
    """Wrong: never returns on the world's last rank (the others have answered)."""
    world = MPI.COMM_WORLD
    while world.Get_size() > 1 and world.Get_rank() == world.Get_size() - 1:
        time.sleep(0.01)
    return route(logits, k, capacity_factor)


def test_route_check_fails_a_router_stuck_on_one_rank_on_every_rank(comm, monkeypatch):
    from ddlab.checks import experts as experts_checks

    monkeypatch.setattr(experts_checks, "ROUTE_DEADLINE", 1.0)
    start = time.monotonic()
    with pytest.raises(CheckFailed, match="did not return within 1 s"):
        check_route(route_stuck_on_the_last_rank)
    assert time.monotonic() - start < 30
    comm.Barrier()  # every rank is out of the check


@pytest.mark.parametrize(
    "answer, says",
    [
        (router_with(capacity_k=False), "capacity"),
        (router_with(served="token"), "first choices"),
        (router_with(renormalise=False), "weight"),
        (router_with(loss="max"), "aux_loss"),
    ],
)
def test_route_check_fails_wrong_answers(comm, answer, says):
    with pytest.raises(CheckFailed, match=says):
        check_route(answer)


def test_route_check_fails_its_stub(comm):
    def stub(logits, k, capacity_factor):
        raise NotImplementedError("exercise 15.6")

    with pytest.raises(NotImplementedError):
        check_route(stub)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("route", "ddlab.experts.route", ()),
        ("dispatch", "ddlab.experts.dispatch", ()),
        ("combine", "ddlab.experts.combine", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
