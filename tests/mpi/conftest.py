"""Multi-rank tests: every rank runs the same tests; only rank 0's report is worth reading."""

import pytest
from mpi4py import MPI


@pytest.fixture
def comm() -> MPI.Comm:
    """The world communicator, with a barrier after each test so ranks stay in step."""
    world = MPI.COMM_WORLD
    yield world
    world.Barrier()
