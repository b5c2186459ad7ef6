"""Test-suite plumbing shared by library tests and notebook runs (nbval).

- Every run gets a private IPython directory, so its clusters are its own. Every
  process a test starts carries the test's name (DDLAB_TEST). A notebook's cluster
  must be gone within GONE_WITHIN seconds of nbval killing its kernel (the reaper
  ddlab.runtime.cluster.start() leaves sees to that), and at the end of the run no process
  a test started may remain: either fails, naming the process and the test.
- Notebook cells: a timeout fails the cell. In labs/, a cell tagged `check` must
  raise, and raise because of an exercise stub: a check that passes on a stub
  checks nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import pytest

STUB_ERROR = "NotImplementedError"


def pytest_configure(config: pytest.Config) -> None:
    if "DDLAB_TEST_IPYTHONDIR" not in os.environ:  # the outermost run makes it; ranks under mpiexec inherit it
        made = tempfile.mkdtemp(prefix="ddlab-ipython-")
        os.environ["DDLAB_TEST_IPYTHONDIR"] = made
        # Removed at exit, after an IPython shell a test made in this process has saved its history there
        # (exit functions run last registered first, and the shell registers its own later than this).
        atexit.register(shutil.rmtree, made, ignore_errors=True)
    os.environ["IPYTHONDIR"] = os.environ["DDLAB_TEST_IPYTHONDIR"]
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.setdefault("DDLAB_PROGRESS", "0")  # no progress bars in executed notebooks


MPI_TESTS = Path(__file__).resolve().parent / "tests" / "mpi"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--mpi-suite",
        action="store_true",
        help="collect tests/mpi/ (tests/test_mpi_suites.py runs them under mpiexec)",
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/mpi/ runs only under mpiexec, launched by tests/test_mpi_suites.py."""
    if not config.getoption("--mpi-suite") and MPI_TESTS in (
        collection_path,
        *collection_path.parents,
    ):
        return True
    return None


def _is_lab_notebook(item: pytest.Item) -> bool:
    return Path(str(item.path)).parent.name == "labs"


#: Set to "all" to run every cell of the lab notebooks, not only those ddlab.tools.cellflow picks.
LAB_CELLS = "DDLAB_LAB_CELLS"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In labs/, run only the cells that can differ from the solution's run (ddlab.tools.cellflow):
    the exercises, the checks, what they read, and every cell that may read an exercise's result."""
    if os.environ.get(LAB_CELLS) == "all":
        return
    import nbformat
    from ddlab.tools.cellflow import cells_the_lab_runs

    ordinals: dict[Path, set[int] | None] = {}
    kept, dropped = [], []
    for item in items:
        cell_num = getattr(item, "cell_num", None)
        path = Path(str(item.path))
        if cell_num is None or not _is_lab_notebook(item):
            kept.append(item)
            continue
        if path not in ordinals:
            source = path.parent.parent / "solutions" / path.name
            if not source.exists():  # a lab without its solution beside it: every cell runs
                ordinals[path] = None
            else:
                solution = nbformat.read(str(source), as_version=4)
                code = [i for i, cell in enumerate(solution.cells) if cell.cell_type == "code"]
                runs = cells_the_lab_runs(solution)
                ordinals[path] = {k for k, i in enumerate(code) if i in runs}
        selected = ordinals[path]
        (kept if selected is None or cell_num in selected else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


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


#: Seconds within which a notebook's cluster must be gone once nbval has killed its kernel (the
#: reaper that ddlab.runtime.cluster.start() leaves watches the kernel: README, "If a kernel dies").
GONE_WITHIN = 10
#: The environment variable naming, in every process a test starts, the test that started it.
STARTED_BY = "DDLAB_TEST"


def _started_by(item: pytest.Item) -> str:
    """A notebook's path (one kernel serves all its cells), else the test's id."""
    return item.nodeid.split("::")[0] if getattr(item, "cell", None) is not None else item.nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before nbval starts a kernel (or a test starts anything): mark what follows as this test's."""
    os.environ[STARTED_BY] = _started_by(item)


def _our_processes(ipython_dir: str) -> list[psutil.Process]:
    """Controller, engine, mpiexec and reaper processes started under this run's IPython dir."""
    found = []
    launchers = {p.pid for p in psutil.Process().parents()}  # the mpiexec running this very pytest
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid in launchers:
            continue
        cmdline = " ".join(proc.info["cmdline"] or [])
        if not any(word in cmdline for word in ("ipyparallel", "mpiexec", "prterun", "hydra", ".reaper ")):
            continue
        try:
            if proc.environ().get("IPYTHONDIR") == ipython_dir:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _describe(procs: list[psutil.Process]) -> str:
    """One line per process: pid, the test that started it, its command line."""
    lines = []
    for proc in procs:
        try:
            lines.append(
                f"left behind: pid {proc.pid}, started by {proc.environ().get(STARTED_BY, '?')}: "
                f"{' '.join(proc.cmdline())[:200]}"
            )
        except psutil.Error:
            continue  # it left after all
    return "\n".join(lines)


def _kill(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=5)


@pytest.fixture
def cluster_processes():
    """A function listing this run's controller, engine and mpiexec processes (see _our_processes)."""
    return lambda: _our_processes(os.environ["IPYTHONDIR"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a notebook's last cell nbval kills its kernel: its cluster must be gone within GONE_WITHIN s."""
    yield
    if getattr(item, "cell", None) is None or (nextitem is not None and nextitem.parent is item.parent):
        return
    notebook = _started_by(item)

    def left() -> list[psutil.Process]:
        mine = []
        for proc in _our_processes(os.environ["IPYTHONDIR"]):
            with contextlib.suppress(psutil.Error):
                if proc.environ().get(STARTED_BY) == notebook:
                    mine.append(proc)
        return mine

    deadline = time.monotonic() + GONE_WITHIN
    while (survivors := left()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if survivors:
        report = _describe(survivors)
        _kill(survivors)
        raise AssertionError(f"{notebook}: its cluster outlived its kernel by {GONE_WITHIN} s:\n{report}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if any process a test started is still there, naming it and the test."""
    left = _our_processes(os.environ["IPYTHONDIR"])
    if left:
        print(_describe(left))
        _kill(left)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
