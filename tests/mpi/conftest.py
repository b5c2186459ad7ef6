"""Multi-rank tests: every rank runs the same tests; only rank 0's report is worth reading."""

from __future__ import annotations

import contextlib
import faulthandler
from collections.abc import Callable, Iterator

import pytest
from mpi4py import MPI


@pytest.fixture
def comm() -> Iterator[MPI.Comm]:
    """A duplicate of the world communicator for this test alone, freed after a barrier.

    Every test gets its own context, so a message an earlier test left unreceived can never be
    matched by a later test's receive (it once was: tests/mpi/test_point_to_point.py's collect
    took a stray empty message from rank 2 on the shared world communicator)."""
    mine = MPI.COMM_WORLD.Dup()
    yield mine
    mine.Barrier()
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
