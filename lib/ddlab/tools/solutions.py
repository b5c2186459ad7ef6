"""A solution notebook's answers outside the notebook: its chosen code cells run in one namespace.

Tests and benchmarks that need the student's path (the functions a solution cell defines, as the
engines define them) call `run_cells` instead of copying the functions: the notebook stays the
single source of its answers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import nbformat

#: The cell magic that sends a cell to the engines; run here, the cell is plain Python without it.
PX = "%%px\n"


def run_cells(notebook: Path, wanted: Callable[[str], bool], namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run, in order and in one namespace, the code cells of `notebook` whose source `wanted` accepts.

    A leading `%%px` line is dropped (the cell runs in this process, as on an engine); tracebacks name
    the notebook. `namespace` holds what the cells expect from cells not run (it is filled in and
    returned); a new one by default. LookupError if `wanted` accepts no cell.
    """
    cells = [cell.source for cell in nbformat.read(notebook, as_version=4).cells if cell.cell_type == "code"]
    chosen = [source for source in cells if wanted(source)]
    if not chosen:
        raise LookupError(f"no code cell of {notebook} is the one asked for")
    namespace = {} if namespace is None else namespace
    for source in chosen:
        exec(compile(source.removeprefix(PX), str(notebook), "exec"), namespace)
    return namespace


def exercises(*numbers: str, setup: str | None = None) -> Callable[[str], bool]:
    """`run_cells`'s choice of the cells of these exercises ("14.1": the cell whose `# Exercise 14.1:` comment
    names it) and, if given, of the cells that start with `setup`, such as the engines' imports ("%%px\\nimport torch")."""
    pattern = re.compile(r"# Exercise (?:" + "|".join(re.escape(n) for n in numbers) + r"):")

    def wanted(source: str) -> bool:
        return bool(pattern.search(source)) or (setup is not None and source.startswith(setup))

    return wanted
