"""Multi-rank tests: every rank runs the same tests; only rank 0's report is worth reading."""

from __future__ import annotations

import contextlib
import faulthandler
from collections.abc import Callable, Iterator

import pytest
from mpi4py import MPI


@pytest.fixture
def comm() -> MPI.Comm:
    """The world communicator, with a barrier after each test so ranks stay in step."""
    world = MPI.COMM_WORLD
    yield world
    world.Barrier()


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
