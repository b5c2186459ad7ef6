"""ddlab.checks exposes every check, lazily, and importing it stays cheap."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import ddlab.checks

CHECKS_DIR = Path(ddlab.checks.__file__).parent


def defined_checks() -> dict[str, str]:
    """{check name: module} for every public check_* function in the package's modules."""
    found = {}
    for path in CHECKS_DIR.glob("*.py"):
        if path.name.startswith("_"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("check_"):
                found[node.name] = path.stem
    return found


def test_every_check_is_exported_from_its_module():
    exported = {name: module for name, module in ddlab.checks._WHERE.items() if name.startswith("check_")}
    assert exported == defined_checks()
    for name in exported:
        assert callable(getattr(ddlab.checks, name))


def test_importing_the_checks_starts_neither_mpi_nor_torch():
    code = "import sys, ddlab.checks; ddlab.checks.check_block_range; print(sorted(m for m in ('mpi4py.MPI', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_failed_check_shows_its_message_without_the_checks_frames(capsys):
    """IPython (and each engine under %%px) shows a CheckFailed as its message alone: no wall of frames."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell(
        "from ddlab.checks import CheckFailed\ndef check():\n    raise CheckFailed('rank 1: the halo is wrong')\ncheck()"
    )
    shown = capsys.readouterr().out
    assert "CheckFailed: rank 1: the halo is wrong" in shown
    assert "Traceback" not in shown and "check()" not in shown
    shell.run_cell("def student():\n    raise ValueError('a bug in the answer')\nstudent()")
    other = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert "Traceback" in other and "student()" in other  # other errors keep their frames
