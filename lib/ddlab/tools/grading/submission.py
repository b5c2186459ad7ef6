"""What runs of a submission: the student's cells, with the lab's check cells put back."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat

from ..labgen import CHECK_TAG, EXERCISE_RE, Check, checks, exercise_id


def is_check(cell: nbformat.NotebookNode) -> bool:
    """A check cell, or what is left of one: tagged check, an nbgrader test cell, or calling a check."""
    meta = cell.get("metadata", {})
    return cell.cell_type == "code" and bool(
        CHECK_TAG in meta.get("tags", [])
        or meta.get("nbgrader", {}).get("grade")
        or "ddlab.checks.check_" in cell.source
    )


def _defines(function: str) -> re.Pattern[str]:
    """A line that defines `function` (a def, async or not, or an assignment to its name)."""
    return re.compile(
        rf"^\s*(?:(?:async\s+)?def\s+{re.escape(function)}\s*\(|{re.escape(function)}\s*=[^=])", re.MULTILINE
    )


def _exercise_cell(cells: list[nbformat.NotebookNode], check: Check) -> int | None:
    """Index of the last code cell of the check's exercise, or None if the submission has none.

    The cell is found by its first line ("# Exercise 3.2: allreduce_ring"); if a student
    changed that line, by the id nbgrader's metadata gave the cell, and then by the cell
    that defines the exercise's function."""
    own_id = exercise_id(check.exercise, check.function)
    ways = (
        lambda cell: any(match.group(1) == check.exercise for match in EXERCISE_RE.finditer(cell.source)),
        lambda cell: (
            re.fullmatch(rf"{own_id}(_\d+)?", cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", ""))
            is not None
        ),
        lambda cell: _defines(check.function).search(cell.source) is not None,
    )
    for way in ways:
        found = [index for index, cell in enumerate(cells) if cell.cell_type == "code" and way(cell)]
        if found:
            return found[-1]
    return None


def prepare(
    lab: nbformat.NotebookNode, submission: nbformat.NotebookNode
) -> tuple[nbformat.NotebookNode, dict[int, Check], set[str]]:
    """The notebook to grade; by cell index in it, the check each restored check cell is; the lost checks.

    The submission's check cells (or edited or emptied ones) are dropped, and the lab's
    go back in right after the cell of the exercise they check. A check whose exercise
    cell is gone goes where the check before it went (and runs on whatever is defined):
    its grade id is in the set returned, so its result can say why.
    """
    kept = [copy.deepcopy(cell) for cell in submission.cells if not is_check(cell)]
    after: dict[int, list[Check]] = {}
    previous, lost = -1, set()
    for check in checks(lab):
        anchor = _exercise_cell(kept, check)
        if anchor is None:
            lost.add(check.grade_id)
        previous = previous if anchor is None else anchor
        after.setdefault(previous, []).append(check)
    notebook = copy.deepcopy(submission)
    notebook.cells, placed = [], {}
    for index in range(-1, len(kept)):
        if index >= 0:
            notebook.cells.append(kept[index])
        for check in after.get(index, []):
            placed[len(notebook.cells)] = check
            notebook.cells.append(copy.deepcopy(lab.cells[check.index]))
    return notebook, placed, lost


def student_name(path: Path, lab_name: str) -> str:
    """The file's name, or for nbgrader's layout (submitted/STUDENT/ASSIGNMENT/LAB.ipynb) the student's folder."""
    if path.name != lab_name:
        return path.stem
    return path.parent.parent.name if path.parent.parent.parent.name == "submitted" else path.parent.name
