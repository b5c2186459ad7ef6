"""Lab 02 under mpiexec: the references pass their checks, and every check catches wrong versions.

Each wrong version below is a mistake students make. Every rank runs every test; the
checks raise the same CheckFailed on all ranks, so the assertions agree everywhere.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from ddlab import collectives as library
from ddlab.checks import CheckFailed, check_bcast_linear, check_bcast_tree, check_reduce_linear, check_reduce_tree
from ddlab.checks._core import run_counted
from ddlab.runtime.counting import CountingComm, ForbiddenCollective, gather_traffic, rounds
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer); these tests use them as valid answers and as the bases of
# wrong ones.
collectives = SimpleNamespace(
    **{
        name: unguarded(getattr(library, name))
        for name in ("bcast_linear", "bcast_tree", "reduce_linear", "reduce_tree", "bcast_mpi", "reduce_mpi")
    }
)

STALL = 3.0  # seconds a check waits for a message that never comes, in tests that provoke one


def _fails(check, fn, **kwargs) -> str:
    """Run the check on fn, which must fail; return the message."""
    with pytest.raises(CheckFailed) as caught:
        check(fn, **kwargs)
    return str(caught.value)


def _needs(size: int) -> None:
    if MPI.COMM_WORLD.Get_size() < size:
        pytest.skip(f"needs {size} ranks: on fewer, a linear broadcast or reduce is a binomial tree")


# The references ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "check, fn",
    [
        (check_bcast_linear, collectives.bcast_linear),
        (check_bcast_tree, collectives.bcast_tree),
        (check_reduce_linear, collectives.reduce_linear),
        (check_reduce_tree, collectives.reduce_tree),
    ],
    ids=["bcast_linear", "bcast_tree", "reduce_linear", "reduce_tree"],
)
def test_references_pass(comm, check, fn, capsys):
    check(fn)
    out = capsys.readouterr().out
    assert out.startswith("passed: ") if comm.Get_rank() == 0 else out == ""


@pytest.mark.parametrize("root", [0, -1])
@pytest.mark.parametrize("dtype", ["float64", "int32", "complex128"])
def test_references_agree_with_mpi(comm, root, dtype):
    root = root % comm.Get_size()
    x = (np.arange(10) * (comm.Get_rank() + 2)).astype(dtype)[::2]
    for mine, theirs in [
        (collectives.bcast_linear, collectives.bcast_mpi),
        (collectives.bcast_tree, collectives.bcast_mpi),
    ]:
        np.testing.assert_array_equal(mine(comm, x, root), theirs(comm, x, root))
    for mine in (collectives.reduce_linear, collectives.reduce_tree):
        got, want = mine(comm, x, root), collectives.reduce_mpi(comm, x, root)
        if comm.Get_rank() == root:
            np.testing.assert_array_equal(got, want)
        else:
            assert got is None
    np.testing.assert_array_equal(x, (np.arange(10) * (comm.Get_rank() + 2)).astype(dtype)[::2])


def test_stub_passes_through(comm):
    def stub(comm, x, root=0):
        raise NotImplementedError("Exercise 2.1 (bcast_linear) is not done yet")

    with pytest.raises(NotImplementedError, match="Exercise 2.1"):
        check_bcast_linear(stub)


# Rounds, as the tree checks count them ------------------------------------------------


def _traffic(comm, fn, x, root=0):
    counting = CountingComm(comm)
    fn(counting, x, root)
    counting.free()
    return gather_traffic(counting)


def test_rounds_of_linear_and_tree(comm):
    size, x = comm.Get_size(), np.ones(3)
    tree = math.ceil(math.log2(size))
    assert rounds(_traffic(comm, collectives.bcast_linear, x)) == size - 1
    assert rounds(_traffic(comm, collectives.bcast_tree, x)) == tree
    linear_reduce = _traffic(comm, collectives.reduce_linear, x)
    assert rounds(linear_reduce) == 1  # all senders at once ...
    assert rounds(linear_reduce, one_receive_at_a_time=True) == size - 1  # ... into one receiver
    assert rounds(_traffic(comm, collectives.reduce_tree, x), one_receive_at_a_time=True) == tree


def test_rounds_match_wildcard_receives(comm):
    def bcast_irecv_any_tag(comm, x, root=0):
        """A binomial tree whose receives are posted with Irecv and no tag (MPI.ANY_TAG)."""
        rank, size = comm.Get_rank(), comm.Get_size()
        me, out, mask = (rank - root) % size, np.array(x, order="C"), 1
        while mask < size:
            if me & mask:
                comm.Irecv(out, source=(me - mask + root) % size).Wait()
                break
            mask <<= 1
        mask >>= 1
        while mask > 0:
            if me + mask < size:
                comm.Send(out, dest=(me + mask + root) % size, tag=5)
            mask >>= 1
        return out

    tree = math.ceil(math.log2(comm.Get_size()))
    assert rounds(_traffic(comm, bcast_irecv_any_tag, np.ones(2))) == tree
    check_bcast_tree(bcast_irecv_any_tag)


# Wrong roots and results on the wrong rank ---------------------------------------------


def bcast_linear_from_0(comm, x, root=0):
    """Ignores `root`: always broadcasts rank 0's x."""
    return collectives.bcast_linear(comm, x, 0)


def bcast_tree_from_0(comm, x, root=0):
    return collectives.bcast_tree(comm, x, 0)


def test_bcast_wrong_root(comm):
    for check, fn in [(check_bcast_linear, bcast_linear_from_0), (check_bcast_tree, bcast_tree_from_0)]:
        message = _fails(check, fn)
        assert "root=1) on 2 ranks" in message and "wrong result" in message
        assert "the result is wrong at" in message and "not rank 0" in message


def reduce_to_0(comm, x, root=0):
    """Ignores `root`: the sum lands on rank 0."""
    return collectives.reduce_linear(comm, x, 0)


def reduce_everywhere(comm, x, root=0):
    """Returns the sum on every rank (an allreduce), not only on the root."""
    total = collectives.reduce_linear(comm, x, root)
    return collectives.bcast_linear(comm, x if total is None else total, root)


def test_reduce_result_on_wrong_rank(comm):
    message = _fails(check_reduce_linear, reduce_to_0)
    assert "root=1) on 2 ranks" in message
    assert "rank 1: returned None, expected the sum" in message
    assert "rank 0: returned a ndarray, expected None" in message
    message = _fails(check_reduce_tree, reduce_everywhere)
    assert "root=0) on 2 ranks" in message and "rank 1: returned a ndarray, expected None" in message


# Inputs modified, results that alias the input ------------------------------------------


def bcast_into_x(comm, x, root=0):
    """Receives straight into x (changing the caller's array), returns a copy."""
    if comm.Get_rank() == root:
        for dest in range(comm.Get_size()):
            if dest != root:
                comm.Send(np.ascontiguousarray(x), dest=dest)
    else:
        comm.Recv(x, source=root)
    return x.copy()


def bcast_returns_x(comm, x, root=0):
    """The root returns x itself."""
    out = collectives.bcast_linear(comm, x, root)
    return x if comm.Get_rank() == root else out


def reduce_adds_into_x(comm, x, root=0):
    """The root adds the others' arrays into its own x."""
    if comm.Get_rank() != root:
        comm.Send(np.ascontiguousarray(x), dest=root)
        return None
    incoming = np.empty(x.shape, x.dtype)
    for source in range(comm.Get_size()):
        if source != root:
            comm.Recv(incoming, source=source)
            x += incoming
    return x.copy()


def test_input_modified(comm):
    message = _fails(check_bcast_linear, bcast_into_x)
    assert "x was modified" in message and "rank 1: changed its input: x after the call is wrong at" in message
    message = _fails(check_reduce_linear, reduce_adds_into_x)
    assert "on 2 ranks" in message and "rank 0: changed its input" in message
    message = _fails(check_bcast_tree, bcast_returns_x)
    assert "on 1 rank," in message and "returned x itself" in message


# Rank counts that are not powers of two ------------------------------------------------


def bcast_hypercube(comm, x, root=0):
    """floor(log2 P) hypercube steps: right only when P is a power of two."""
    rank, size = comm.Get_rank(), comm.Get_size()
    me, out = (rank - root) % size, np.array(x, order="C")
    for k in range(int(math.log2(size))):
        partner = ((me ^ (1 << k)) + root) % size
        if me < 1 << k:
            comm.Send(out, dest=partner)
        elif me < 2 << k:
            comm.Recv(out, source=partner)
    return out


def reduce_hypercube(comm, x, root=0):
    """Partners me XOR 2^k without checking they exist: waits forever when P is not a power of two."""
    rank, size = comm.Get_rank(), comm.Get_size()
    me, total, incoming = (rank - root) % size, np.array(x, order="C"), np.empty(x.shape, x.dtype)
    for k in range(math.ceil(math.log2(size))):
        partner = ((me ^ (1 << k)) + root) % size
        if me & (1 << k):
            comm.Send(total, dest=partner)
            return None
        comm.Recv(incoming, source=partner)
        total += incoming
    return total


def test_power_of_two_only(comm):
    _needs(3)
    message = _fails(check_bcast_tree, bcast_hypercube)
    assert "on 3 ranks" in message and "rank 2: the result is wrong" in message
    message = _fails(check_reduce_tree, reduce_hypercube, timeout=STALL)
    assert "on 3 ranks" in message and "raised an error" in message and "Stalled" in message


# Wrong message counts --------------------------------------------------------------------


def bcast_to_self_too(comm, x, root=0):
    """The root also sends to itself (and receives its own message)."""
    out = np.array(x, order="C")
    if comm.Get_rank() == root:
        requests = [comm.Isend(out, dest=dest) for dest in range(comm.Get_size())]
        comm.Recv(np.empty_like(out), source=root)
        MPI.Request.Waitall(requests)
    else:
        comm.Recv(out, source=root)
    return out


def bcast_twice(comm, x, root=0):
    """Sends (and receives) everything twice."""
    collectives.bcast_linear(comm, x, root)
    return collectives.bcast_linear(comm, x, root)


def bcast_sends_twice(comm, x, root=0):
    """The root sends twice to each rank, which receives once: the second send never completes."""
    out = np.array(x, order="C")
    if comm.Get_rank() == root:
        for dest in range(comm.Get_size()):
            if dest != root:
                comm.Send(out, dest=dest)
                comm.Send(out, dest=dest)
    else:
        comm.Recv(out, source=root)
    return out


def test_wrong_message_count(comm):
    message = _fails(check_bcast_linear, bcast_to_self_too)
    assert "on 1 rank," in message and "1 message sent, expected P-1 = 0" in message and "0->0" in message
    message = _fails(check_bcast_linear, bcast_twice)
    assert "on 2 ranks" in message and "2 messages sent, expected P-1 = 1" in message
    message = _fails(check_bcast_tree, bcast_twice)
    assert (
        "2 messages sent, expected P-1 = 1" in message
        and "rank 0 sent 2 messages; in a binomial tree no rank sends" in message
    )
    message = _fails(check_bcast_linear, bcast_sends_twice, timeout=STALL)
    assert "on 2 ranks" in message and "Stalled" in message and "Send to rank 1" in message


def test_tree_that_is_linear(comm):
    _needs(4)
    message = _fails(check_bcast_tree, collectives.bcast_linear)
    assert "on 4 ranks" in message and "took 3 rounds" in message and "ceil(log2 P) = 2" in message
    assert "rank 0 sent 3 messages" in message and "0->1, 0->2, 0->3" in message
    message = _fails(check_reduce_tree, collectives.reduce_linear)
    assert (
        "on 4 ranks" in message
        and "took 3 rounds" in message
        and "rank 0 received 3 messages; in a binomial tree no rank receives" in message
    )


def bcast_tree_nearest_child_first(comm, x, root=0):
    """The tree's messages, but each rank sends to its nearest child first."""
    rank, size = comm.Get_rank(), comm.Get_size()
    me = (rank - root) % size
    out = np.array(x, order="C") if me == 0 else np.empty(x.shape, x.dtype)
    limit = size if me == 0 else me & -me
    if me:
        comm.Recv(out, source=(me - limit + root) % size)
    step = 1
    while step < limit:
        if me + step < size:
            comm.Send(out, dest=(me + step + root) % size)
        step *= 2
    return out


def reduce_tree_farthest_child_first(comm, x, root=0):
    """The tree's messages, but each rank receives from its farthest child first."""
    rank, size = comm.Get_rank(), comm.Get_size()
    me = (rank - root) % size
    total, part = np.array(x, order="C"), np.empty(x.shape, x.dtype)
    limit = me & -me if me else 1 << (size - 1).bit_length()
    step = limit // 2
    while step >= 1:
        if me + step < size:
            comm.Recv(part, source=(me + step + root) % size)
            total += part
        step //= 2
    if me:
        comm.Send(total, dest=(me - limit + root) % size)
        return None
    return total


def test_tree_messages_in_the_wrong_order(comm):
    _needs(4)
    message = _fails(check_bcast_tree, bcast_tree_nearest_child_first)
    assert "took 3 rounds" in message and "look at their order" in message
    message = _fails(check_reduce_tree, reduce_tree_farthest_child_first)
    assert "took 3 rounds" in message and "look at their order" in message


def test_linear_that_is_a_tree(comm):
    _needs(4)
    message = _fails(check_bcast_linear, collectives.bcast_tree)
    assert "on 4 ranks" in message and "one from the root to each other rank" in message
    message = _fails(check_reduce_linear, collectives.reduce_tree)
    assert "on 4 ranks" in message and "one from each other rank to the root" in message


# The MPI library's own collectives ---------------------------------------------------------


def bcast_with_mpi(comm, x, root=0):
    out = np.array(x, order="C")
    comm.Bcast(out, root=root)
    return out


def reduce_with_mpi(comm, x, root=0):
    out = np.empty(x.shape, x.dtype) if comm.Get_rank() == root else None
    comm.Reduce(np.ascontiguousarray(x), out, root=root)
    return out


def test_mpi_collectives_refused(comm):
    for check in (check_bcast_linear, check_bcast_tree):
        message = _fails(check, bcast_with_mpi)
        assert "ForbiddenCollective: comm.Bcast" in message and "on 1 rank," in message
    for check in (check_reduce_linear, check_reduce_tree):
        assert "ForbiddenCollective: comm.Reduce" in _fails(check, reduce_with_mpi)


def test_object_form_of_an_allowed_collective_is_named(comm):
    counting = CountingComm(comm, allow=("Allgather",))
    try:
        with pytest.raises(ForbiddenCollective, match="pickled object form of Allgather: this exercise may call only"):
            counting.allgather(1)
        with pytest.raises(ForbiddenCollective, match="comm.Bcast is the MPI library's own collective"):
            counting.Bcast(np.zeros(1))
    finally:
        counting.free()


def irecv_into_a_small_buffer(comm):
    """Rank 0 posts Irecv's of 2 float64 and waits with Waitall; the others send a pickle, far larger."""
    if comm.Get_rank() == 0:
        requests = [comm.Irecv(np.zeros(2), source=peer, tag=7) for peer in range(1, comm.Get_size())]
        MPI.Request.Waitall(requests)
    else:
        comm.send(list(range(100)), dest=0, tag=7)


def test_a_request_mpi_completes_with_an_error_fails_the_check_and_the_next_one_runs(comm):
    """MPI_ERR_TRUNCATE on a request the student waits for: the wait returns, the check names the cause."""
    with pytest.raises(CheckFailed, match="larger than the receive buffer.*lowercase send pickles"):
        run_counted(comm, irecv_into_a_small_buffer, (), "a truncated Irecv", timeout=3.0)
    assert run_counted(comm, collectives.bcast_linear, (np.arange(3.0),), "the next check")[0].tolist() == [0, 1, 2]


# Memory layout -------------------------------------------------------------------------------


def bcast_sends_x_as_is(comm, x, root=0):
    """Sends x itself: fails on views that are not contiguous."""
    if comm.Get_rank() == root:
        for dest in range(comm.Get_size()):
            if dest != root:
                comm.Send(x, dest=dest)
        return x.copy()
    out = np.empty_like(x)
    comm.Recv(out, source=root)
    return out


def bcast_mixed_layouts(comm, x, root=0):
    """The root sends in x's memory order, the others receive in C order."""
    if comm.Get_rank() == root:
        out = x.copy(order="K")
        for dest in range(comm.Get_size()):
            if dest != root:
                comm.Send(out, dest=dest)
        return out
    out = np.empty(x.shape, x.dtype)
    comm.Recv(out, source=root)
    return out


def test_layouts(comm):
    message = _fails(check_bcast_linear, bcast_sends_x_as_is)
    assert "strided view" in message and "not contiguous" in message and "np.ascontiguousarray" in message
    message = _fails(check_bcast_linear, bcast_mixed_layouts)
    assert "transposed view" in message and "rank 1: the result is wrong at" in message
    assert "not C-contiguous" in message


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("bcast_linear", "ddlab.collectives.bcast_linear", ()),
        ("bcast_tree", "ddlab.collectives.bcast_tree", ()),
        ("reduce_linear", "ddlab.collectives.reduce_linear", ()),
        ("reduce_tree", "ddlab.collectives.reduce_tree", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
