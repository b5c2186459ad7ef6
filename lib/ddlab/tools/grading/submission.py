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


def _defines(function: str, assigned: bool = False) -> re.Pattern[str]:
    """A line that defines `function`: a def (async or not), or with `assigned` an assignment to its name."""
    name = re.escape(function)
    return re.compile(rf"^\s*{name}\s*=[^=]" if assigned else rf"^\s*(?:async\s+)?def\s+{name}\s*\(", re.MULTILINE)


def _exercise_cell(cells: list[nbformat.NotebookNode], check: Check) -> int | None:
    """Index of the cell after which the check goes, or None if the submission has no cell of its exercise.

    The exercise's cells are found by their first line ("# Exercise 3.2: allreduce_ring") or, if a student
    changed it, by the id nbgrader's metadata gave them; the cells that define the exercise's function count too
    (an answer written in a new cell below the stub). The check goes after the last of these; with none, after
    the last cell that assigns the function's name."""
    own_id = re.compile(rf"{exercise_id(check.exercise, check.function)}(_\d+)?")

    def is_own(cell: nbformat.NotebookNode) -> bool:
        grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "")
        headers = (match.group(1) for match in EXERCISE_RE.finditer(cell.source))
        return (
            check.exercise in headers
            or own_id.fullmatch(grade_id) is not None
            or bool(_defines(check.function).search(cell.source))
        )

    for found in (is_own, lambda cell: bool(_defines(check.function, assigned=True).search(cell.source))):
        indices = [index for index, cell in enumerate(cells) if cell.cell_type == "code" and found(cell)]
        if indices:
            return indices[-1]
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
    path = path.resolve()  # a file of the lab's own name given bare: its folder's name
    return path.parent.parent.name if path.parent.parent.parent.name == "submitted" else path.parent.name
