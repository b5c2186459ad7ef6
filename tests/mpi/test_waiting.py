"""The one wait with a deadline (ddlab.runtime.waiting.Watch): a wait that cannot succeed fails in time, a
peer's failure ends it at once, a request the watch gave up is never taken for one that completed, and the
check harness reports a stub on every rank whatever the other ranks met."""

import time

import numpy as np
import pytest
from ddlab.checks import CheckFailed
from ddlab.checks._core import run_counted
from ddlab.runtime.comm import drain
from ddlab.runtime.waiting import PeerFailed, Stalled, Watch
from mpi4py import MPI


def test_a_wait_nobody_answers_fails_at_its_deadline(comm):
    watch = Watch(comm, timeout=0.3)
    try:
        start = time.monotonic()
        with pytest.raises(Stalled, match="waited 0 s for nothing"):
            watch.poll(lambda: False, "nothing")
        assert 0.3 <= time.monotonic() - start < 2.0
    finally:
        watch.free()


def test_a_peers_failure_ends_a_wait_promptly(comm):
    """Rank 1 fails as the others start waiting: they give up long before the deadline."""
    watch = Watch(comm, timeout=30.0)
    try:
        comm.Barrier()
        if comm.rank == 1:
            watch.fail_all("boom")
        else:
            start = time.monotonic()
            with pytest.raises(PeerFailed, match=r"gave up on nothing: rank 1 failed \(boom\)"):
                watch.poll(lambda: False, "nothing")
            assert time.monotonic() - start < 1.0  # a few ms on a quiet machine; generous under load
        watch.settle()
    finally:
        watch.free()


def test_a_wait_on_a_request_the_watch_gave_up_raises(comm):
    """Rank 1 fails; rank 0's watched receive (which no message will match) is given up by the watch's helper
    and so completes: polling it must raise the failure, not return as if its buffer had been filled."""
    watch, quiet = Watch(comm, timeout=30.0), comm.Dup()
    try:
        comm.Barrier()
        if comm.rank == 1:
            watch.fail_all("boom")
        elif comm.rank == 0:
            request = watch.watched(quiet.Irecv(np.empty(4), source=1, tag=5), "a message that never comes")
            until = time.monotonic() + 10
            while not request.Get_status() and time.monotonic() < until:  # completed by the helper, not freed
                time.sleep(1e-3)
            assert watch.failure is not None
            with pytest.raises(PeerFailed, match=r"rank 1 failed \(boom\)"):
                watch.poll(request.Test, "a message that never comes")
        watch.settle()
    finally:
        watch.free()
        quiet.Free()


def test_a_stub_on_some_ranks_is_reported_on_all_whatever_the_others_met(comm):
    """Rank 0 fails its own way (its peers' notice, then an error) while the others are stubs: every rank
    raises the stub, none is left in a collective the others never call."""

    def roles(counting):
        if counting.Get_rank() != 0:
            raise NotImplementedError("Exercise 9.9 is not done yet")
        try:
            counting.Recv(np.empty(1), source=1, tag=3)
        except PeerFailed as err:
            raise RuntimeError("the server stopped") from err

    with pytest.raises(NotImplementedError, match="Exercise 9.9"):
        run_counted(comm, roles, (), "roles", timeout=20.0)


def test_a_message_sent_after_its_receive_was_given_up_is_not_left_on_comm(comm):
    """Rank 0's first receive fails (truncated), so the watch gives up the one from the last rank, which sends
    its empty message only once told of the failure: run_counted receives it, so comm holds nothing afterwards.
    (It once stayed, for the caller's next receive from any rank to take: collect took such a message.)"""
    size = comm.Get_size()
    if size < 3:
        pytest.skip("needs a rank whose receive fails and another whose message comes late")
    last = size - 1

    def late(counting):
        rank = counting.Get_rank()
        if rank == 0:
            MPI.Request.Waitall([counting.Irecv(np.zeros(1), source=peer, tag=7) for peer in (1, last)])
        elif rank == 1:
            counting.Send(np.zeros(4), dest=0, tag=7)  # larger than rank 0's buffer
        elif rank == last:
            with pytest.raises(PeerFailed):
                counting.Recv(np.empty(1), source=0, tag=8)  # never sent: ends when rank 0 fails
            counting.Isend(np.zeros(0), dest=0, tag=7).Wait()

    with pytest.raises(CheckFailed, match="larger than the receive buffer"):
        run_counted(comm, late, (), "a message after the failure", timeout=20.0)
    comm.Barrier()
    assert comm.allgather(drain(comm, 5.0)) == [[]] * size
