"""Multi-rank tests: every rank runs the same tests; only rank 0's report is worth reading.

After every test, no message may be left unreceived on the world communicator or on the test's
own `comm`: a message left behind would be matched by the next receive from anyone, the student's
included, so the test that left it fails, naming the sender, tag and bytes (`ddlab.runtime.comm.drain`
finds them).
"""

from __future__ import annotations

import contextlib
import faulthandler
from collections.abc import Callable, Iterator

import pytest
from ddlab.runtime.comm import drain
from mpi4py import MPI

#: Seconds a rank waits for each other rank's end-of-test marker, once every rank has finished the test.
MARKER_WAIT = 30.0


def _fail_on_unreceived(comm: MPI.Comm, where: str) -> None:
    """Fail the test if a message is still pending on comm (a collective: the same verdict on every rank).

    The barrier waits for every rank to finish the test; `drain` then finds (and receives) every message
    sent on comm before it, even one still on its way."""
    comm.Barrier()
    rank = comm.Get_rank()
    found = [
        f"rank {left.source} -> rank {rank}: "
        + ("a receive left posted took the end marker" if left.tag is None else f"tag {left.tag}, {left.nbytes} bytes")
        for left in drain(comm, MARKER_WAIT)
    ]
    everyone = [line for lines in comm.allgather(found) for line in lines]
    if everyone:
        pytest.fail(f"messages left unreceived on {where} after the test:\n" + "\n".join(everyone), pytrace=False)


@pytest.fixture(autouse=True)
def _nothing_left_on_the_world() -> Iterator[None]:
    yield
    _fail_on_unreceived(MPI.COMM_WORLD, "MPI.COMM_WORLD")


@pytest.fixture
def comm() -> Iterator[MPI.Comm]:
    """A duplicate of the world communicator for this test alone, checked for leftovers and freed after it.

    Every test gets its own context, so a message an earlier test left unreceived can never be
    matched by a later test's receive (it once was: tests/mpi/test_point_to_point.py's collect
    took a stray empty message from rank 2 on the shared world communicator)."""
    mine = MPI.COMM_WORLD.Dup()
    yield mine
    try:
        _fail_on_unreceived(mine, "the test's comm")
    finally:
        mine.Free()


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def deadline() -> Callable[[float], contextlib.AbstractContextManager[None]]:
    """`with deadline(seconds):` ends this process, with every thread's traceback, if the block takes longer:
    a hang fails (the MPI job with it) instead of holding the suite. Run pytest with -s to see the traceback."""
    return _deadline
