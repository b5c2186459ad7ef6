"""Lab 01 under mpiexec: the reference functions, and every check against wrong answers.

Every rank runs the same tests in the same order; a check raises the same error on
every rank, so each rank's pytest.raises sees it. Wrong implementations that block
get a short timeout, so a deadlock costs seconds, not a hung job.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from ddlab import p2p
from ddlab.checks import CheckFailed, check_collect, check_exchange, check_ping_pong
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

SHORT = 3.0  # seconds a wrong implementation may block before the check gives up


def expect_failure(check, fn, *words: str) -> str:
    """Run check on fn (which must fail on every rank); the message must name every word."""
    with pytest.raises(CheckFailed) as info:
        check(fn, timeout=SHORT)
    message = str(info.value)
    for word in words:
        assert word in message, message
    return message


# Reference functions ---------------------------------------------------------------
def test_exchange_reference_swaps_pairs(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    data = np.full(2**18, float(rank))  # 2 MiB: a blocking Send-then-Recv would deadlock
    got = p2p.exchange(comm, data)
    partner = rank ^ 1 if rank ^ 1 < size else rank
    assert np.all(got == partner) and np.all(data == rank) and got is not data


def test_collect_reference_gathers_any_lengths(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    got = p2p.collect(comm, np.arange(rank * 3, dtype=float))
    if rank == 0:
        assert [list(a) for a in got] == [list(range(r * 3)) for r in range(size)]
    else:
        assert got is None


def test_ping_pong_reference_times_on_ranks_0_and_1(comm):
    result = p2p.ping_pong(comm, np.ones(1000), 5)
    if comm.Get_rank() < 2:
        assert isinstance(result, float) and result > 0
    else:
        assert result is None


def test_sweep_gives_every_rank_rank_0s_times(comm):
    sizes = [8, 4096, 2**20]
    times = p2p.sweep(comm, sizes, repeats=2, trials=1)
    everyone = comm.allgather(times)
    assert times.shape == (3,) and np.all(times > 0)
    assert all(np.array_equal(t, everyone[0]) for t in everyone)


def test_ping_pong_alone_is_an_error():
    with pytest.raises(ValueError, match="two ranks"):
        p2p.ping_pong(MPI.COMM_SELF, np.ones(1), 1)


# The checks pass on the references ----------------------------------------------------
def test_checks_pass_on_references(comm):
    check_collect(unguarded(p2p.collect))
    check_exchange(unguarded(p2p.exchange))
    check_ping_pong(unguarded(p2p.ping_pong))


def test_checks_let_stubs_through_on_every_rank(comm):
    def stub(*args):
        raise NotImplementedError("Exercise 1.x is not done yet")

    for check in (check_collect, check_exchange, check_ping_pong):
        with pytest.raises(NotImplementedError):
            check(stub)


# exchange: wrong answers ------------------------------------------------------------
def _partner(comm):
    partner = comm.Get_rank() ^ 1
    return partner if partner < comm.Get_size() else None


def test_exchange_check_catches_the_deadlock(comm):
    def send_then_recv(comm, data):
        partner = _partner(comm)
        if partner is None:
            return data.copy()
        received = np.empty_like(data)
        comm.Send(data, dest=partner)
        comm.Recv(received, source=partner)
        return received

    start = time.monotonic()
    expect_failure(check_exchange, send_then_recv, "deadlock", "Sendrecv", "parity")
    assert time.monotonic() - start < 60  # gave up after the short timeout, not never


def test_exchange_check_catches_the_wrong_partner(comm):
    def ring_shift(comm, data):
        rank, size = comm.Get_rank(), comm.Get_size()
        if size == 1:
            return data.copy()
        received = np.empty_like(data)
        comm.Sendrecv(data, dest=(rank + 1) % size, recvbuf=received, source=(rank - 1) % size)
        return received

    expect_failure(check_exchange, ring_shift, "returned rank")


def test_exchange_check_catches_a_changed_input(comm):
    def in_place(comm, data):
        partner = _partner(comm)
        if partner is None:
            return data.copy()
        comm.Sendrecv_replace(data, dest=partner, source=partner)
        return data

    if comm.Get_size() == 1:
        pytest.skip("one rank has no partner to swap with")
    expect_failure(check_exchange, in_place, "changed its input")


def test_exchange_check_catches_pickled_messages(comm):
    def pickled(comm, data):
        partner = _partner(comm)
        return data.copy() if partner is None else comm.sendrecv(data, dest=partner, source=partner)

    expect_failure(check_exchange, pickled, "bytes", "buffer API")


def test_exchange_check_catches_a_lone_rank_that_talks(comm):
    def lone_rank_sends_to_itself(comm, data):
        partner = comm.Get_rank() ^ 1
        partner = partner if partner < comm.Get_size() else comm.Get_rank()
        received = np.empty_like(data)
        comm.Sendrecv(data, dest=partner, recvbuf=received, source=partner)
        return received

    expect_failure(check_exchange, lone_rank_sends_to_itself, "no partner")


def test_exchange_check_catches_a_lone_rank_returning_its_own_array(comm):
    def lone_rank_returns_data(comm, data):
        partner = comm.Get_rank() ^ 1
        if partner >= comm.Get_size():
            return data
        received = np.empty_like(data)
        comm.Sendrecv(data, dest=partner, recvbuf=received, source=partner)
        return received

    expect_failure(check_exchange, lone_rank_returns_data, "a new array")


def test_exchange_check_catches_a_float64_receive_buffer(comm):
    def default_dtype(comm, data):
        partner = _partner(comm)
        if partner is None:
            return data.copy()
        received = np.empty(data.shape)  # float64, whatever data's dtype
        comm.Sendrecv(data, dest=partner, recvbuf=received, source=partner)
        return received

    if comm.Get_size() == 1:
        pytest.skip("one rank has no partner to swap with")
    expect_failure(check_exchange, default_dtype, "dtype")


# ping_pong: wrong answers -----------------------------------------------------------
def _bounce(comm, buf, repeats):
    """The right message pattern; returns the elapsed seconds (not yet per message)."""
    rank = comm.Get_rank()
    start = time.perf_counter()
    for _ in range(repeats):
        if rank == 0:
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
        elif rank == 1:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
    return time.perf_counter() - start


def test_ping_pong_check_catches_a_message_to_rank_2(comm):
    def also_rank_2(comm, buf, repeats):
        rank = comm.Get_rank()
        elapsed = _bounce(comm, buf, repeats)
        if comm.Get_size() > 2 and rank == 0:
            comm.Send(buf, dest=2)
        if comm.Get_size() > 2 and rank == 2:
            comm.Recv(np.empty_like(buf), source=0)
        return elapsed / (2 * repeats) if rank < 2 else None

    if comm.Get_size() > 2:
        expect_failure(check_ping_pong, also_rank_2, "rank 2", "only ranks 0 and 1")


def test_ping_pong_check_catches_an_unanswered_message_to_rank_2(comm):
    def rank_2_never_receives(comm, buf, repeats):
        if comm.Get_size() > 2 and comm.Get_rank() == 0:
            comm.Send(buf, dest=2)
        elapsed = _bounce(comm, buf, repeats)
        return elapsed / (2 * repeats) if comm.Get_rank() < 2 else None

    if comm.Get_size() > 2:
        expect_failure(check_ping_pong, rank_2_never_receives, "rank 2")


def test_ping_pong_check_catches_one_message_too_many(comm):
    def one_more(comm, buf, repeats):
        rank = comm.Get_rank()
        elapsed = _bounce(comm, buf, repeats)
        if rank == 0:
            comm.Send(buf, dest=1)
        elif rank == 1:
            comm.Recv(buf, source=0)
        return elapsed / (2 * repeats) if rank < 2 else None

    expect_failure(check_ping_pong, one_more, "expected 2 * repeats")


def test_ping_pong_check_catches_pickled_messages(comm):
    def pickled(comm, buf, repeats):
        rank = comm.Get_rank()
        start = time.perf_counter()
        for _ in range(repeats):
            if rank == 0:
                comm.send(buf, dest=1)
                comm.recv(source=1)
            elif rank == 1:
                comm.send(comm.recv(source=0), dest=0)
        return (time.perf_counter() - start) / (2 * repeats) if rank < 2 else None

    expect_failure(check_ping_pong, pickled, "buf.nbytes", "buffer API")


def test_ping_pong_check_catches_a_missing_time_on_rank_1(comm):
    def rank_0_only(comm, buf, repeats):
        elapsed = _bounce(comm, buf, repeats)
        return elapsed / (2 * repeats) if comm.Get_rank() == 0 else None

    expect_failure(check_ping_pong, rank_0_only, "rank 1", "one-way time")


def test_ping_pong_check_catches_milliseconds(comm):
    def milliseconds(comm, buf, repeats):
        elapsed = _bounce(comm, buf, repeats)
        return 1000 * elapsed / (2 * repeats) if comm.Get_rank() < 2 else None

    expect_failure(check_ping_pong, milliseconds, "reference ping-pong")


def test_ping_pong_check_ends_a_deadlock_that_only_the_timed_run_meets(comm):
    def stalls_on_many_repeats(comm, buf, repeats):
        if repeats > 20 and comm.Get_rank() == 0:
            comm.Recv(buf, source=1)  # both wait: rank 1 receives first too
        elapsed = _bounce(comm, buf, repeats)
        return elapsed / (2 * repeats) if comm.Get_rank() < 2 else None

    expect_failure(check_ping_pong, stalls_on_many_repeats, "deadlock")


def test_ping_pong_check_catches_round_trips_and_half_times(comm):
    def round_trip(comm, buf, repeats):
        elapsed = _bounce(comm, buf, repeats)
        return elapsed / repeats if comm.Get_rank() < 2 else None

    def per_repeat_quarter(comm, buf, repeats):
        elapsed = _bounce(comm, buf, repeats)
        return elapsed / (4 * repeats) if comm.Get_rank() < 2 else None

    expect_failure(check_ping_pong, round_trip, "one-way time (a round trip is two messages)")
    expect_failure(check_ping_pong, per_repeat_quarter, "divide by the number of one-way messages")


def test_ping_pong_check_accepts_mpi_wtime_and_rank_1_first(comm):
    def wtime(comm, buf, repeats):
        rank = comm.Get_rank()
        if rank > 1:
            return None
        start = MPI.Wtime()
        for _ in range(repeats):
            if rank == 1:
                comm.Recv(buf, source=0)
                comm.Send(buf, dest=0)
            else:
                comm.Send(buf, dest=1)
                comm.Recv(buf, source=1)
        return (MPI.Wtime() - start) / (2 * repeats)

    check_ping_pong(wtime, timeout=SHORT)


# collect: wrong answers --------------------------------------------------------------
def _collect_any_source(by_source: bool):
    """Receives from any source, in arrival order; stores by sender (valid) or appends (wrong)."""

    def collect(comm, data):
        if comm.Get_rank() != 0:
            comm.Send(data, dest=0)
            return None
        arrays, status = [data.copy()] + [None] * (comm.Get_size() - 1), MPI.Status()
        for arrived in range(1, comm.Get_size()):
            comm.Probe(source=MPI.ANY_SOURCE, status=status)
            buf = np.empty(status.Get_count(MPI.DOUBLE))
            comm.Recv(buf, source=status.Get_source())
            arrays[status.Get_source() if by_source else arrived] = buf
        return arrays

    return collect


def test_collect_check_forces_the_arrival_order(comm):
    """Arrival order is wrong on every run (the check makes the highest rank's message arrive first)."""
    check_collect(_collect_any_source(by_source=True), timeout=SHORT)
    if comm.Get_size() >= 3:
        expect_failure(check_collect, _collect_any_source(by_source=False), "status.Get_source()")


def test_collect_check_catches_a_fixed_buffer(comm):
    def fixed_length(comm, data):
        if comm.Get_rank() != 0:
            comm.Send(data, dest=0)
            return None
        arrays = [data.copy()]
        for source in range(1, comm.Get_size()):
            buf = np.zeros(len(data))  # assumes every rank's length is rank 0's
            comm.Recv(buf, source=source)
            arrays.append(buf)
        return arrays

    expect_failure(check_collect, fixed_length, "rank 0")


def test_collect_check_catches_a_missing_own_array(comm):
    def others_only(comm, data):
        if comm.Get_rank() != 0:
            comm.Send(data, dest=0)
            return None
        arrays, status = [None] * comm.Get_size(), MPI.Status()
        for _ in range(comm.Get_size() - 1):
            comm.Probe(status=status)
            arrays[status.Get_source()] = np.empty(status.Get_count(MPI.DOUBLE))
            comm.Recv(arrays[status.Get_source()], source=status.Get_source())
        return arrays[1:]  # forgot item 0, rank 0's own array

    expect_failure(check_collect, others_only, "expected a list of")


def test_a_never_completing_irecv_fails_within_the_timeout(comm):
    """Waiting on an Irecv nobody sends to (Waitall, or the request's own Wait) fails the check in time."""

    def forgets_to_send(wait):
        def exchange(comm, data):
            received, partner = np.empty_like(data), _partner(comm)
            if partner is not None:  # receives from its partner, which never sends
                wait(comm.Irecv(received, source=partner))
            return data.copy() if partner is None else received

        return exchange

    for wait in (lambda request: MPI.Request.Waitall([request]), lambda request: request.Wait()):
        start = time.monotonic()
        message = expect_failure(
            check_exchange, forgets_to_send(wait), "Irecv from rank", "never completed", "deadlock", "Waitall"
        )
        assert "Stalled" in message
        assert time.monotonic() - start < 4 * SHORT  # the timeout, plus the sizes that pass


# Point-to-point calls beyond Send/Recv -----------------------------------------------
def test_exchange_check_accepts_other_valid_point_to_point_calls(comm):
    def with_sendrecv_replace(comm, data):
        partner, received = _partner(comm), data.copy()
        if partner is not None:
            comm.Sendrecv_replace(received, dest=partner, source=partner)
        return received

    def with_issend(comm, data):
        partner, received = _partner(comm), np.empty_like(data)
        if partner is None:
            return data.copy()
        MPI.Request.Waitall([comm.Irecv(received, source=partner), comm.Issend(data, dest=partner)])
        return received

    for fn in (with_sendrecv_replace, with_issend):
        check_exchange(fn, timeout=SHORT)  # raises CheckFailed on every rank if it fails


def test_uncounted_calls_are_refused_with_what_to_use(comm):
    def buffered(comm, data):
        partner, received = _partner(comm), np.empty_like(data)
        if partner is None:
            return data.copy()
        comm.Bsend(data, dest=partner)
        comm.Recv(received, source=partner)
        return received

    def persistent(comm, data):
        partner, received = _partner(comm), np.empty_like(data)
        if partner is None:
            return data.copy()
        requests = [comm.Send_init(data, dest=partner), comm.Recv_init(received, source=partner)]
        MPI.Prequest.Startall(requests)
        MPI.Request.Waitall(requests)
        return received

    expect_failure(check_exchange, buffered, "UncountedCall", "comm.Bsend", "comm.Send")
    expect_failure(check_exchange, persistent, "UncountedCall", "comm.Send_init", "comm.Isend")


def test_an_mpi_error_gets_a_hint(comm):
    def short_buffer(comm, data):  # receives into a buffer one element too small: MPI_ERR_TRUNCATE
        partner = _partner(comm)
        if partner is None:
            return data.copy()
        received = np.empty(max(data.size - 1, 0), dtype=data.dtype)
        comm.Sendrecv(data, dest=partner, recvbuf=received, source=partner)
        return received

    if comm.Get_size() > 1:
        expect_failure(check_exchange, short_buffer, "an error inside MPI", "a receive buffer was smaller")


def test_new_communicators_are_counted_refused_or_fail_in_time(comm):
    """Dup's and Split's messages count; a Split some rank never calls fails in time; other constructors are refused."""

    def on_a_dup(comm, data):
        partner, received, dup = _partner(comm), np.empty_like(data), comm.Dup()
        if partner is None:
            return data.copy()
        dup.Sendrecv(data, dest=partner, recvbuf=received, source=partner)
        return received

    def split_by_pairs(comm, data):
        pair = comm.Split(comm.Get_rank() // 2, comm.Get_rank())
        if pair.Get_size() == 1:
            return data.copy()
        received = np.empty_like(data)
        pair.Sendrecv(data, dest=1 - pair.Get_rank(), recvbuf=received, source=1 - pair.Get_rank())
        return received

    def split_by_some(comm, data):
        if comm.Get_rank() % 2 == 0:  # odd ranks never call Split
            comm.Split(0, comm.Get_rank())
        return data.copy()

    def split_or_dup(comm, data):  # rank 0 splits while the others dup
        comm.Split(0, comm.Get_rank()) if comm.Get_rank() == 0 else comm.Dup()
        return data.copy()

    def on_a_cartesian_grid(comm, data):
        comm.Create_cart([comm.Get_size()])
        return data.copy()

    check_exchange(on_a_dup, timeout=SHORT)
    check_exchange(split_by_pairs, timeout=SHORT)
    start = time.monotonic()
    expect_failure(check_exchange, split_by_some, "Stalled", "Split to be called on every rank")
    assert time.monotonic() - start < 4 * SHORT
    expect_failure(check_exchange, on_a_cartesian_grid, "UncountedCall", "comm.Create_cart", "comm.Split")
    if comm.Get_size() > 1:
        expect_failure(
            check_exchange,
            split_or_dup,
            "MismatchedCollective",
            "rank 0 Split, rank 1 Dup",
            "the same collective calls, in the same order",
        )


def test_collect_check_catches_rank_0s_own_array_returned(comm):
    def own_array_itself(comm, data):
        arrays = _collect_any_source(by_source=True)(comm, data)
        if arrays is not None:
            arrays[0] = data
        return arrays

    expect_failure(check_collect, own_array_itself, "a copy")


def test_a_request_never_waited_for_fails(comm):
    """An Isend whose request is dropped (never Wait-ed) fails, naming the call; Wait and Waitall pass."""

    def drops_the_isend(comm, data):
        partner, received = _partner(comm), np.empty_like(data)
        if partner is None:
            return data.copy()
        comm.Isend(data, dest=partner)
        comm.Recv(received, source=partner)
        return received

    def waits_for_each(comm, data):
        partner, received = _partner(comm), np.empty_like(data)
        if partner is None:
            return data.copy()
        receive, send = comm.Irecv(received, partner), comm.Isend(data, partner)
        receive.Wait()
        send.wait()
        return received

    expect_failure(check_exchange, drops_the_isend, "Isend to rank", "never waited for", "Wait")
    check_exchange(waits_for_each, timeout=SHORT)


def test_an_iprobe_loop_no_message_ends_fails_within_the_timeout(comm):
    """Polling Iprobe for one message too many stops at the timeout instead of spinning forever."""

    def one_too_many(comm, data):
        if comm.Get_rank() != 0:
            comm.Send(data, dest=0)
            return None
        arrays, status = [data.copy()] + [None] * (comm.Get_size() - 1), MPI.Status()
        for _ in range(comm.Get_size()):  # counts rank 0 too: the last poll never succeeds
            while not comm.Iprobe(source=MPI.ANY_SOURCE, status=status):
                time.sleep(1e-4)
            arrays[status.Get_source()] = np.empty(status.Get_count(MPI.DOUBLE))
            comm.Recv(arrays[status.Get_source()], source=status.Get_source())
        return arrays

    start = time.monotonic()
    with pytest.raises(CheckFailed, match="polled Iprobe .* none came"):
        check_collect(one_too_many, timeout=1.0)
    assert time.monotonic() - start < 4.0


def _collect_matched(nonblocking: bool):
    """collect with a matched probe (Mprobe, or an Improbe loop), then the message's own receive."""

    def collect(comm, data):
        if comm.Get_rank() != 0:
            comm.Send(data, dest=0)
            return None
        arrays, status = [data.copy()] + [None] * (comm.Get_size() - 1), MPI.Status()
        for _ in range(comm.Get_size() - 1):
            if nonblocking:
                message = None
                while message is None:
                    message = comm.Improbe(source=MPI.ANY_SOURCE, status=status)
            else:
                message = comm.Mprobe(source=MPI.ANY_SOURCE, status=status)
            buf = np.empty(status.Get_count(MPI.DOUBLE))
            if nonblocking:
                message.Irecv(buf).Wait()
            else:
                message.Recv(buf)
            arrays[status.Get_source()] = buf
        return arrays

    return collect


def test_collect_check_accepts_a_matched_probe(comm):
    """Mprobe then the message's Recv (or Improbe then Irecv): Probe's thread-safe form, counted like it."""
    check_collect(_collect_matched(nonblocking=False), timeout=SHORT)
    check_collect(_collect_matched(nonblocking=True), timeout=SHORT)


def test_a_matched_probe_no_message_ends_fails_within_the_timeout(comm):
    def one_too_many(comm, data):
        if comm.Get_rank() != 0:
            comm.Send(data, dest=0)
            return None
        arrays, status = [data.copy()] + [None] * (comm.Get_size() - 1), MPI.Status()
        for _ in range(comm.Get_size()):  # counts rank 0 too: the last Mprobe never matches
            message = comm.Mprobe(source=MPI.ANY_SOURCE, status=status)
            arrays[status.Get_source()] = np.empty(status.Get_count(MPI.DOUBLE))
            message.Recv(arrays[status.Get_source()])
        return arrays

    start = time.monotonic()
    with pytest.raises(CheckFailed, match="Mprobe for a message from any rank"):
        check_collect(one_too_many, timeout=1.0)
    assert time.monotonic() - start < 4.0


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("collect", "ddlab.p2p.collect", ()),
        ("exchange", "ddlab.p2p.exchange", ()),
        ("ping_pong", "ddlab.p2p.ping_pong", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
