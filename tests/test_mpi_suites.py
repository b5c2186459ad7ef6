"""Run the multi-rank tests in tests/mpi/ under the venv's mpiexec.

The whole folder runs in one job on 4 ranks (the course's laptop cluster), and the library's
tests run again in one on 3 (a rank count that is not a power of two: padded shards, uneven
splits, folds): one job pays the start-up of MPI, pytest and torch once instead of once per
file. The checks' wrong-answer tests (test_*_checks.py) run on the labs' 4 ranks only, but
for the allreduce checks, whose answers must fold a rank count that is not a power of two.
Every rank runs the same tests. A test that hangs is stopped by its own timeout, and the job
is killed if it outlives its own, so a deadlock fails the run instead of hanging it. To run
one file: `python -m ddlab.runtime.mpi -n 4 python -m pytest tests/mpi/test_<topic>.py
--mpi-suite`.
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


#: Check tests that run on 3 ranks too: the answers they judge treat a rank count that is not a power of two apart.
ODD_CHECKS = ("test_allreduce_checks",)


def suite(ranks: int) -> list[str]:
    """What runs on this many ranks: the whole folder on 4, on others the library's tests and ODD_CHECKS."""
    if ranks == 4:
        return [str(MPI_TESTS)]
    files = sorted(MPI_TESTS.glob("test_*.py"))
    return [str(f) for f in files if not f.stem.endswith("_checks") or f.stem in ODD_CHECKS]


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
        *suite(ranks),
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
