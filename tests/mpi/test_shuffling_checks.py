"""Lab 12's checks catch wrong exchange plans, Alltoallvs and redistributions, and accept valid alternatives.

Every rank runs the same tests; the checks themselves make all ranks agree.
"""

from __future__ import annotations

import numpy as np
import pytest
from ddlab.checks import CheckFailed, check_exchange_plan, check_exchange_samples, check_redistribute
from ddlab.runtime.reference import unguarded
from ddlab.shuffling import exchange_plan, exchange_samples, redistribute
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
exchange_plan = unguarded(exchange_plan)
exchange_samples = unguarded(exchange_samples)
redistribute = unguarded(redistribute)


def plan_with_replacement(counts, rank, q, epoch, seed=0):
    """Picks the samples to send with replacement: some go out twice, others are lost."""
    send, recv_counts = exchange_plan(counts, rank, q, epoch, seed)
    rng = np.random.default_rng([seed, epoch, rank])
    chosen = np.concatenate(send)
    chosen = np.sort(rng.integers(0, counts[rank], len(chosen)))
    return np.split(chosen, np.cumsum([len(s) for s in send])[:-1]), recv_counts


def plan_without_agreement(counts, rank, q, epoch, seed=0):
    """Each rank deals its samples out evenly and assumes it gets its own count back evenly."""
    k = round(q * counts[rank])
    positions = np.random.default_rng([seed, epoch, rank]).permutation(counts[rank])[:k]
    size = len(counts)
    return [positions[d::size] for d in range(size)], [len(positions[d::size]) for d in range(size)]


def plan_miscounted_on_rank_0(counts, rank, q, epoch, seed=0):
    """Right everywhere but on rank 0, which expects one sample more from the last rank: only it can tell."""
    send, recv_counts = exchange_plan(counts, rank, q, epoch, seed)
    if rank == 0:
        recv_counts = list(recv_counts)
        recv_counts[-1] += 1
    return send, recv_counts


def plan_keeping_everything(counts, rank, q, epoch, seed=0):
    """Sends round(Q m) samples, all to itself: every count agrees, nothing moves."""
    k = round(q * counts[rank])
    send = [np.empty(0, np.int64) for _ in counts]
    send[rank] = np.sort(np.random.default_rng([seed, epoch, rank]).permutation(counts[rank])[:k])
    return send, [k if s == rank else 0 for s in range(len(counts))]


def plan_ignoring_epoch(counts, rank, q, epoch, seed=0):
    """The same exchange every epoch."""
    return exchange_plan(counts, rank, q, 0, seed)


def plan_picked_in_int16(counts, rank, q, epoch, seed=0):
    """Picks its positions as int16, then returns int64: past 32,767 samples a rank they wrap negative."""
    send, recv_counts = exchange_plan(counts, rank, q, epoch, seed)
    return [positions.astype(np.int16).astype(np.int64) for positions in send], recv_counts


def plan_in_uint16(counts, rank, q, epoch, seed=0):
    """The right positions, returned as uint16 arrays: the lab asks for int64."""
    send, recv_counts = exchange_plan(counts, rank, q, epoch, seed)
    return [positions.astype(np.uint16) for positions in send], recv_counts


def plan_alternative(counts, rank, q, epoch, seed=0):
    """Valid: floor(q m) per rank, picked and dealt from other seeds than the reference's."""
    size = len(counts)
    picked = [int(q * m) for m in counts]
    starts = np.concatenate([[0], np.cumsum(picked)])
    destination = np.random.default_rng([seed, epoch, 99]).permutation(np.repeat(np.arange(size), picked))
    chosen = np.random.default_rng([seed, epoch, rank, 5]).permutation(counts[rank])[: picked[rank]]
    mine = destination[starts[rank] : starts[rank + 1]]
    return (
        [chosen[mine == d] for d in range(size)],
        [int(np.sum(destination[starts[s] : starts[s + 1]] == rank)) for s in range(size)],
    )


def exchange_displacements_in_rows(comm, x, send, recv_counts):
    """Counts in elements, displacements in rows: they disagree whenever a sample has several features."""
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    outgoing = np.ascontiguousarray(x[np.concatenate(send)])
    incoming = np.empty((sum(recv_counts), *x.shape[1:]), x.dtype)
    rows_out, rows_in = [len(s) for s in send], list(recv_counts)
    comm.Alltoallv(
        [outgoing, ([r * row for r in rows_out], np.cumsum([0] + rows_out[:-1]))],
        [incoming, ([r * row for r in rows_in], np.cumsum([0] + rows_in[:-1]))],
    )
    return incoming


def exchange_point_to_point(comm, x, send, recv_counts):
    """Right rows, but by Isend/Recv instead of the Alltoallv."""
    rank, size = comm.Get_rank(), comm.Get_size()
    requests = [comm.Isend(np.ascontiguousarray(x[send[d]]), d) for d in range(size) if d != rank]
    parts = []
    for s in range(size):
        part = np.empty((recv_counts[s], *x.shape[1:]), x.dtype)
        if s == rank:
            part[...] = x[send[rank]]
        else:
            comm.Recv(part, source=s)
        parts.append(part)
    MPI.Request.Waitall(requests)
    return np.concatenate(parts)


def exchange_with_row_type(comm, x, send, recv_counts):
    """Valid: a derived datatype of one row, counts and displacements in rows."""
    outgoing = np.ascontiguousarray(x[np.concatenate(send)])
    incoming = np.empty((sum(recv_counts), *x.shape[1:]), x.dtype)
    row = MPI.Datatype.Create_contiguous(MPI._typedict[x.dtype.char], int(np.prod(x.shape[1:], dtype=np.int64)))
    row.Commit()
    try:
        out_counts, in_counts = [len(s) for s in send], list(recv_counts)
        comm.Alltoallv(
            [outgoing, out_counts, np.cumsum([0] + out_counts[:-1]).tolist(), row],
            [incoming, in_counts, np.cumsum([0] + in_counts[:-1]).tolist(), row],
        )
    finally:
        row.Free()
    return incoming


def exchange_counts_in_rows(comm, x, send, recv_counts):
    """Counts and displacements in rows, the buffers in elements: each rank gets the first 1/f of its rows' numbers."""
    outgoing = np.ascontiguousarray(x[np.concatenate(send)])
    incoming = np.zeros((sum(recv_counts), *x.shape[1:]), x.dtype)
    out_counts, in_counts = np.array([len(s) for s in send]), np.array(recv_counts)
    comm.Alltoallv(
        [outgoing, (out_counts, np.cumsum(out_counts) - out_counts)],
        [incoming, (in_counts, np.cumsum(in_counts) - in_counts)],
    )
    return incoming


def exchange_reverses_x_on_rank_0(comm, x, send, recv_counts):
    """Right rows, but rank 0 reverses the caller's array in place afterwards: only rank 0 sees it."""
    got = exchange_samples(comm, x, send, recv_counts)
    if comm.Get_rank() == 0:
        x[:] = x[::-1].copy()
    return got


def exchange_in_position_order(comm, x, send, recv_counts):
    """Sends each rank its rows in position order (sorted), not in the order send[d] lists them."""
    return exchange_samples(comm, x, [np.sort(positions) for positions in send], recv_counts)


@pytest.mark.parametrize(
    "plan, message",
    [
        (plan_with_replacement, "more than once|loses or duplicates"),
        (plan_without_agreement, "expects .* samples from rank|would hold"),
        (plan_ignoring_epoch, "same as epoch"),
        (plan_keeping_everything, "to itself: the exchange moves nothing"),
        (plan_miscounted_on_rank_0, "rank 0: .*expects .* samples from rank|rank 0: .*would hold"),
        (plan_picked_in_int16, "counts=\\[70000.*outside .*do not fit 16 bits; keep them int64"),
        (plan_in_uint16, "holds uint16 positions: return int64 arrays"),
    ],
)
def test_wrong_plans_fail(comm, plan, message):
    with pytest.raises(CheckFailed, match=message):
        check_exchange_plan(plan)


@pytest.mark.parametrize(
    "plan, message",
    [(plan_ignoring_epoch, "same as epoch"), (plan_keeping_everything, "moves nothing")],
)
def test_plans_that_do_not_mix_fail_on_the_grader_s_draw_too(comm, plan, message, seed):
    """The mixing case is drawn as well (its size and q), not only the notebook's 200 samples."""
    seed(2027)
    with pytest.raises(CheckFailed, match=f"seed 2027\\): .*{message}"):
        check_exchange_plan(plan)


@pytest.mark.parametrize(
    "exchange, message",
    [
        (exchange_displacements_in_rows, "outside the|rows received"),
        (exchange_point_to_point, "called comm.Alltoallv 0 times"),
        (exchange_counts_in_rows, "rows received is wrong .*in elements, not rows\\?"),
        (exchange_reverses_x_on_rank_0, "rank 0: .*changed x"),
        (exchange_in_position_order, "rows received is wrong .*in the order send\\[d\\] lists them"),
    ],
)
def test_wrong_exchanges_fail(comm, exchange, message):
    with pytest.raises(CheckFailed, match=message):
        check_exchange_samples(exchange)


@pytest.mark.parametrize("plan", [exchange_plan, plan_alternative])
def test_valid_plans_pass(comm, plan):
    check_exchange_plan(plan)


@pytest.mark.parametrize("exchange", [exchange_samples, exchange_with_row_type])
def test_valid_exchanges_pass(comm, exchange):
    check_exchange_samples(exchange)


def test_stub_error_passes_through(comm):
    def stub(*args):
        raise NotImplementedError("Exercise 12.1: exchange_plan")

    with pytest.raises(NotImplementedError, match="12.1"):
        check_exchange_plan(stub)


def _lookup(holds, dtype=np.int64):
    """owner[i], position[i]: the rank holding sample i and its row there."""
    n = sum(len(h) for h in holds)
    owner, position = np.empty(n, np.int64), np.empty(n, dtype)
    for r, ids in enumerate(holds):
        owner[ids], position[ids] = r, np.arange(len(ids))
    return owner, position


def _alltoallv(comm, x, owner, position, needs, narrow=np.int64):
    """The right Alltoallv; returns what arrived (grouped by source) and each arrival's source."""
    rank, size = comm.Get_rank(), comm.Get_size()
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    out_ids = [needs[d][owner[needs[d]] == rank] for d in range(size)]
    outgoing = np.ascontiguousarray(x[position[np.concatenate(out_ids)]])
    out_counts = np.array([len(i) for i in out_ids]) * row
    source = owner[needs[rank]]
    in_counts = np.bincount(source, minlength=size) * row
    incoming = np.empty((len(source), *x.shape[1:]), x.dtype)
    comm.Alltoallv(
        [outgoing, (out_counts, np.cumsum(out_counts) - out_counts)],
        [incoming, (in_counts, np.cumsum(in_counts) - in_counts)],
    )
    return incoming, source


def redistribute_grouped_by_source(comm, x, holds, needs):
    """The right rows, left grouped by source: forgets to put them in the order of needs."""
    owner, position = _lookup(holds)
    return _alltoallv(comm, x, owner, position, needs)[0]


def redistribute_int16_positions(comm, x, holds, needs):
    """Rows indexed through int16 positions: wraps past 32,767 samples on one rank."""
    owner, position = _lookup(holds, np.int16)
    incoming, source = _alltoallv(comm, x, owner, position, needs)
    placed = np.empty_like(incoming)
    placed[np.argsort(source, kind="stable")] = incoming
    return placed


def redistribute_symmetric_counts(comm, x, holds, needs):
    """Assumes it receives from each rank as many rows as it sends to it: counts disagree between ranks."""
    rank, size = comm.Get_rank(), comm.Get_size()
    owner, position = _lookup(holds)
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    out_ids = [needs[d][owner[needs[d]] == rank] for d in range(size)]
    outgoing = np.ascontiguousarray(x[position[np.concatenate(out_ids)]])
    counts = np.array([len(i) for i in out_ids]) * row
    incoming = np.empty((len(needs[rank]), *x.shape[1:]), x.dtype)
    comm.Alltoallv([outgoing, (counts, np.cumsum(counts) - counts)], [incoming, (counts, np.cumsum(counts) - counts)])
    return incoming


def redistribute_sending_everything(comm, x, holds, needs):
    """Right rows, but every rank sends all it holds to every rank and each keeps what it needs."""
    rank, size = comm.Get_rank(), comm.Get_size()
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    outgoing = np.ascontiguousarray(np.concatenate([x] * size))
    out_counts = np.full(size, len(x) * row)
    in_counts = np.array([len(h) for h in holds]) * row
    incoming = np.empty((sum(len(h) for h in holds), *x.shape[1:]), x.dtype)
    comm.Alltoallv(
        [outgoing, (out_counts, np.cumsum(out_counts) - out_counts)],
        [incoming, (in_counts, np.cumsum(in_counts) - in_counts)],
    )
    everything = np.empty_like(incoming)
    everything[np.concatenate(holds)] = incoming
    return everything[needs[rank]]


def redistribute_object_api(comm, x, holds, needs):
    """The lower-case alltoall of Python lists: the lab asks for one Alltoallv."""
    rank, size = comm.Get_rank(), comm.Get_size()
    owner, position = _lookup(holds)
    arrived = comm.alltoall([x[position[needs[d][owner[needs[d]] == rank]]] for d in range(size)])
    source = owner[needs[rank]]
    placed = np.empty((len(source), *x.shape[1:]), x.dtype)
    placed[np.argsort(source, kind="stable")] = np.concatenate(arrived)
    return placed


def redistribute_sorting_holds_on_rank_0(comm, x, holds, needs):
    """Right rows, but rank 0 sorts the diagram's holds in place (to search it): only rank 0 sees it."""
    got = redistribute(comm, x, holds, needs)
    if comm.Get_rank() == 0:
        for ids in holds:
            ids.sort()
    return got


def redistribute_skipping_when_holding_nothing(comm, x, holds, needs):
    """A rank that holds nothing returns without joining the Alltoallv: the others would wait forever."""
    if len(x) == 0:
        return np.empty((len(needs[comm.Get_rank()]), *x.shape[1:]), x.dtype)
    return redistribute(comm, x, holds, needs)


def redistribute_local_copy(comm, x, holds, needs):
    """Valid: lookups by searching the sorted ids, its own rows copied locally (0 bytes to itself), a row datatype."""
    rank, size = comm.Get_rank(), comm.Get_size()
    every_id = np.concatenate(holds)
    by_id = np.argsort(every_id)
    holder = np.repeat(np.arange(size), [len(h) for h in holds])[by_id]
    row_of = np.concatenate([np.arange(len(h)) for h in holds])[by_id]
    slot = [np.searchsorted(every_id[by_id], needs[d]) for d in range(size)]
    out_rows = [row_of[slot[d]][holder[slot[d]] == rank] if d != rank else row_of[:0] for d in range(size)]
    outgoing = np.ascontiguousarray(x[np.concatenate(out_rows)])
    sources = holder[slot[rank]]
    in_counts = [int(np.sum(sources == s)) if s != rank else 0 for s in range(size)]
    incoming = np.empty((sum(in_counts), *x.shape[1:]), x.dtype)
    row = MPI.Datatype.Create_contiguous(MPI._typedict[x.dtype.char], int(np.prod(x.shape[1:], dtype=np.int64)))
    row.Commit()
    try:
        out_counts = [len(rows) for rows in out_rows]
        comm.Alltoallv(
            [outgoing, out_counts, np.cumsum([0] + out_counts[:-1]).tolist(), row],
            [incoming, in_counts, np.cumsum([0] + in_counts[:-1]).tolist(), row],
        )
    finally:
        row.Free()
    result = np.empty((len(sources), *x.shape[1:]), x.dtype)
    local = sources == rank
    result[local] = x[row_of[slot[rank]][local]]
    result[np.flatnonzero(~local)[np.argsort(sources[~local], kind="stable")]] = incoming
    return result


@pytest.mark.parametrize(
    "fn, message",
    [
        (redistribute_grouped_by_source, "rows of needs.* in its order\\) is wrong"),
        (redistribute_int16_positions, "70000 int64 samples.*(rows of needs|Error)"),
        (redistribute_symmetric_counts, "sends rank .* bytes but rank|rows of needs.* in its order\\) is wrong"),
        (redistribute_sending_everything, "the Alltoallv sends rank .* bytes, expected"),
        (redistribute_object_api, "comm.alltoall .*may call only comm.Alltoallv"),
        (redistribute_sorting_holds_on_rank_0, "rank 0: .*changed holds"),
    ],
)
def test_wrong_redistributions_fail(comm, fn, message):
    with pytest.raises(CheckFailed, match=message):
        check_redistribute(fn, timeout=3.0)


def test_redistribution_left_waiting_fails_in_time(comm):
    """A rank that skips the Alltoallv leaves the others waiting: the check says so after its timeout."""
    with pytest.raises(CheckFailed, match="waited .* for the other ranks to call Alltoallv"):
        check_redistribute(redistribute_skipping_when_holding_nothing, timeout=1.0)


@pytest.mark.parametrize("fn", [redistribute, redistribute_local_copy])
def test_valid_redistributions_pass(comm, fn):
    check_redistribute(fn)


def test_redistribute_refuses_a_bad_diagram(comm):
    holds = [np.arange(3)] * comm.Get_size()  # every rank claims ids 0..2
    with pytest.raises(ValueError, match="every sample id"):
        redistribute(comm, np.zeros(3), holds, holds)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("exchange_plan", "ddlab.shuffling.exchange_plan", ()),
        ("exchange_samples", "ddlab.shuffling.exchange_samples", ()),
        ("redistribute", "ddlab.shuffling.redistribute", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
