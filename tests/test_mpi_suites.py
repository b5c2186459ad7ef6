"""Run the multi-rank test files in tests/mpi/ under the venv's mpiexec.

Each file runs on 4 ranks (the course's laptop cluster) and on 3 (a rank count that
is not a power of two). Every rank runs the same tests; the job is killed if it
outlives its timeout, so a deadlock fails the run instead of hanging it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddlab.mpi import run_ranks

MPI_TESTS = sorted((Path(__file__).parent / "mpi").glob("test_*.py"))
TIMEOUT = 600


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("ranks", [4, 3])
@pytest.mark.parametrize("path", MPI_TESTS, ids=lambda p: p.stem)
def test_under_mpiexec(path: Path, ranks: int) -> None:
    command = [sys.executable, "-m", "pytest", str(path), "--mpi-suite", "-q", "-p", "no:cacheprovider",
               "-p", "no:warnings", "--timeout", str(TIMEOUT - 60), "--timeout-method", "thread"]
    try:
        done = run_ranks(ranks, command, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{path.name} on {ranks} ranks did not finish in {TIMEOUT} s:\n{err.output}")
    assert done.returncode == 0, f"{path.name} failed on {ranks} ranks:\n{done.stdout[-20000:]}"
