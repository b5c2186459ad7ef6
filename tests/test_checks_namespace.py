"""ddlab.checks exposes every check, lazily, and importing it stays cheap."""

from __future__ import annotations

import ast
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
