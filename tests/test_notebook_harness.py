"""The notebook harness itself: vacuous checks and timeouts must fail the run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def run_notebook(
    tmp_path: Path, folder: str, cells: list[tuple[str, list[str]]], *args: str, env: dict[str, str] | None = None
) -> str:
    """Run one generated notebook under nbval with the project's conftest; return the report."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for source, tags in cells:
        cell = nbformat.v4.new_code_cell(source)
        if tags:
            cell.metadata["tags"] = tags
        nb.cells.append(cell)
    (tmp_path / folder).mkdir()
    nbformat.write(nb, tmp_path / folder / "99_demo.ipynb")
    for name in ("conftest.py", "pytest.ini"):
        shutil.copy(ROOT / name, tmp_path / name)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", folder, "-p", "no:warnings", "-q", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    return done.stdout + done.stderr


def test_a_lab_check_that_passes_on_its_stub_fails_the_run(tmp_path):
    report = run_notebook(tmp_path, "labs", [("x = 1", []), ("assert x == 1", ["check", "raises-exception"])])
    assert "1 failed" in report and "checks nothing" in report, report


def test_a_lab_check_that_raises_the_stub_error_passes(tmp_path):
    report = run_notebook(
        tmp_path,
        "labs",
        [
            ("def f():\n    raise NotImplementedError('Exercise 9.1 (f) is not done yet')", []),
            ("f()", ["check", "raises-exception"]),
        ],
    )
    assert "2 passed" in report and "failed" not in report, report


def test_a_lab_check_that_fails_for_another_reason_fails_the_run(tmp_path):
    report = run_notebook(tmp_path, "labs", [("undefined_name", ["check", "raises-exception"])])
    assert "1 failed" in report and "raised something else" in report, report


def test_a_cell_timeout_fails_the_run(tmp_path):
    report = run_notebook(
        tmp_path, "solutions", [("import time\ntime.sleep(60)", []), ("y = 2", [])], "--nbval-cell-timeout=3"
    )
    assert "2 failed in" in report and "Timeout" in report, report


def test_a_run_removes_the_private_ipython_directory_it_made(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "DDLAB_TEST_IPYTHONDIR"}, "TMPDIR": str(scratch)}
    seen = tmp_path / "ipythondir.txt"
    cell = f"import os\nopen({str(seen)!r}, 'w').write(os.environ['IPYTHONDIR'])"
    report = run_notebook(tmp_path, "solutions", [(cell, [])], env=env)
    assert "1 passed" in report, report
    used = Path(seen.read_text())
    assert used.parent == scratch and used.name.startswith("ddlab-ipython-"), used
    assert not used.exists(), f"the run left its IPython directory {used}"
