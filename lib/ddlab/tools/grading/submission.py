"""What runs of a submission: the student's cells, with the lab's check cells put back."""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat

from ..labgen import CHECK_TAG, EXERCISE_RE, Check, checks


def is_check(cell: nbformat.NotebookNode) -> bool:
    """A check cell, or what is left of one: tagged check, an nbgrader test cell, or calling a check."""
    meta = cell.get("metadata", {})
    return cell.cell_type == "code" and bool(
        CHECK_TAG in meta.get("tags", [])
        or meta.get("nbgrader", {}).get("grade")
        or "ddlab.checks.check_" in cell.source
    )


def _exercise_cells(cells: list[nbformat.NotebookNode]) -> dict[str, int]:
    """Exercise label ("Exercise 3.2") -> index of the last code cell that carries it."""
    found = {}
    for index, cell in enumerate(cells):
        if cell.cell_type == "code":
            for match in EXERCISE_RE.finditer(cell.source):
                found[match.group(1)] = index
    return found


def prepare(
    lab: nbformat.NotebookNode, submission: nbformat.NotebookNode
) -> tuple[nbformat.NotebookNode, dict[int, Check]]:
    """The notebook to grade and, by cell index in it, the check each restored check cell is.

    The submission's check cells (or edited or emptied ones) are dropped, and the lab's
    go back in right after the cell of the exercise they check. A check whose exercise
    cell is gone goes where the check before it went (and runs on whatever is defined).
    """
    kept = [copy.deepcopy(cell) for cell in submission.cells if not is_check(cell)]
    anchors = _exercise_cells(kept)
    after: dict[int, list[Check]] = {}
    previous = -1
    for check in checks(lab):
        previous = anchors.get(check.exercise, previous)
        after.setdefault(previous, []).append(check)
    notebook = copy.deepcopy(submission)
    notebook.cells, placed = [], {}
    for index in range(-1, len(kept)):
        if index >= 0:
            notebook.cells.append(kept[index])
        for check in after.get(index, []):
            placed[len(notebook.cells)] = check
            notebook.cells.append(copy.deepcopy(lab.cells[check.index]))
    return notebook, placed


def student_name(path: Path, lab_name: str) -> str:
    """The file's name, or for nbgrader's layout (submitted/STUDENT/ASSIGNMENT/LAB.ipynb) the student's folder."""
    if path.name != lab_name:
        return path.stem
    return path.parent.parent.name if path.parent.parent.parent.name == "submitted" else path.parent.name
