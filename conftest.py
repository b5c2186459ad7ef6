"""Test-suite plumbing shared by library tests and notebook runs (nbval).

- Every run gets a private IPython directory, so its clusters are its own, and at
  the end every cluster in it is stopped and no engine process may remain.
- Notebook cells: a timeout fails the cell. In labs/, a cell tagged `check` must
  raise, and raise because of an exercise stub: a check that passes on a stub
  checks nothing.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import psutil
import pytest

STUB_ERROR = "NotImplementedError"


def pytest_configure(config: pytest.Config) -> None:
    if "DDLAB_TEST_IPYTHONDIR" not in os.environ:
        os.environ["DDLAB_TEST_IPYTHONDIR"] = tempfile.mkdtemp(prefix="ddlab-ipython-")
    os.environ["IPYTHONDIR"] = os.environ["DDLAB_TEST_IPYTHONDIR"]
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.setdefault("DDLAB_PROGRESS", "0")  # no progress bars in executed notebooks


MPI_TESTS = Path(__file__).resolve().parent / "tests" / "mpi"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--mpi-suite", action="store_true", help="collect tests/mpi/ (tests/test_mpi_suites.py runs them under mpiexec)"
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/mpi/ runs only under mpiexec, launched by tests/test_mpi_suites.py."""
    if not config.getoption("--mpi-suite") and MPI_TESTS in (collection_path, *collection_path.parents):
        return True
    return None


def _is_lab_notebook(item: pytest.Item) -> bool:
    return Path(str(item.path)).parent.name == "labs"


def _cell_error(item: pytest.Item) -> str:
    outputs = getattr(item, "test_outputs", None) or []
    errors = [o for o in outputs if o.get("output_type") == "error"]
    text = "\n".join(
        f"{o.get('ename', '')}: {o.get('evalue', '')}\n" + "\n".join(o.get("traceback", [])) for o in errors
    )
    if any(o.get("ename") == "AlreadyDisplayedError" for o in errors):
        # %%px streamed the engines' errors as output before raising, so they are there
        text += "\n" + "\n".join(
            o.get("text") or o.get("data", {}).get("text/plain", "")
            for o in outputs
            if o.get("output_type") in ("stream", "display_data")
        )
    return text


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    cell = getattr(item, "cell", None)
    if cell is None or call.when != "call" or not report.passed:
        return
    if getattr(item.parent, "timed_out", False):
        report.outcome = "failed"
        report.longrepr = f"{item.name}: the cell timed out (see --nbval-cell-timeout)."
    elif _is_lab_notebook(item) and "check" in cell.metadata.get("tags", []):
        error = _cell_error(item)
        if STUB_ERROR not in error:
            report.outcome = "failed"
            report.longrepr = f"{item.name}: this check cell must fail on the lab's stub, but it " + (
                "raised something else:\n" + error if error else "passed: it checks nothing."
            )


def _our_processes(ipython_dir: str) -> list[psutil.Process]:
    """Controller, engine and mpiexec processes started under this run's IPython dir."""
    found = []
    launchers = {p.pid for p in psutil.Process().parents()}  # the mpiexec running this very pytest
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid in launchers:
            continue
        cmdline = " ".join(proc.info["cmdline"] or [])
        if not any(word in cmdline for word in ("ipyparallel", "mpiexec", "prterun", "hydra")):
            continue
        try:
            if proc.environ().get("IPYTHONDIR") == ipython_dir:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop clusters left by killed kernels; fail the run if any process survives."""
    from ddlab.runtime.cluster import cleanup_orphans

    ipython_dir = os.environ["IPYTHONDIR"]
    for profile_dir in Path(ipython_dir).glob("profile_ddlab-*"):
        cleanup_orphans(profile_dir.name[len("profile_ddlab-") :])
    deadline = time.monotonic() + 20
    while (left := _our_processes(ipython_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        for proc in left:
            print(f"left behind: pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
            proc.kill()
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
