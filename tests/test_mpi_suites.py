"""Run the multi-rank tests in tests/mpi/ under the venv's mpiexec.

The whole folder runs in one job on 4 ranks (the course's laptop cluster) and in one on 3
(a rank count that is not a power of two): one job pays the start-up of MPI, pytest and
torch once instead of once per file. Every rank runs the same tests. A test that hangs is
stopped by its own timeout, and the job is killed if it outlives its own, so a deadlock
fails the run instead of hanging it. To run one file: `python -m ddlab.runtime.mpi -n 4 python -m
pytest tests/mpi/test_<topic>.py --mpi-suite`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from ddlab.runtime.mpi import run_ranks

MPI_TESTS = Path(__file__).parent / "mpi"
#: Seconds for one test on every rank, and for the whole folder (about 2.5 minutes on 2 quiet cores).
TEST_TIMEOUT = 300
TIMEOUT = 1800


def failures(output: str) -> str:
    """The summary lines naming each failed test, once each, whichever rank printed them."""
    lines = re.findall(r"^(?:FAILED|ERROR) .*$", output, flags=re.MULTILINE)
    return "\n".join(dict.fromkeys(lines))


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("ranks", [4, 3])
def test_under_mpiexec(ranks: int) -> None:
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(MPI_TESTS),
        "--mpi-suite",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:warnings",
        "-o",
        "addopts=",
        "--import-mode=importlib",
        "--timeout",
        str(TEST_TIMEOUT),
        "--timeout-method",
        "thread",
        "-ra",
    ]
    try:
        done = run_ranks(ranks, command, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"tests/mpi on {ranks} ranks did not finish in {TIMEOUT} s:\n{(err.output or '')[-20000:]}")
    assert done.returncode == 0, (
        f"tests/mpi failed on {ranks} ranks:\n{failures(done.stdout)}\n\n{done.stdout[-20000:]}"
    )
