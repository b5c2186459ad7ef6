"""A lab's grades as a CSV that Canvas's gradebook imports: `ddlab grade ... --canvas canvas.csv`.

Canvas's gradebook import (Canvas guide "How do I import grades in the Gradebook?"; the same
columns in Ohio State's guide, teaching.resources.osu.edu, "Import a CSV file to Carmen
Grades") reads a header row that starts with the student columns `Student` (the name,
"Last, First"), `ID` (Canvas's user id), `SIS User ID`, `SIS Login ID` and `Section`, followed
by one column per assignment; an optional second row whose `Student` cell is
`Points Possible` gives each assignment's maximum. Canvas matches a row to a student by `ID`,
`SIS User ID` or `SIS Login ID`; an assignment column whose name Canvas does not know
becomes a new assignment.

The students' identities come from a roster, the CSV that Canvas's own gradebook export
writes (the same five columns first): a student of `ddlab grade` (the notebook's name, or
nbgrader's folder) is found by SIS Login ID, SIS User ID, ID or name. Without a roster the
student's name goes into `Student` and `SIS Login ID`, which suits classes whose
submissions are named by login.
"""

from __future__ import annotations

import csv
from pathlib import Path

from .run import Result

STUDENT_COLUMNS = ("Student", "ID", "SIS User ID", "SIS Login ID", "Section")
POINTS_POSSIBLE = "Points Possible"


def read_roster(path: Path) -> list[dict[str, str]]:
    """The student rows of a Canvas gradebook export (its Points Possible and test-student rows dropped)."""
    with path.open(newline="", encoding="utf-8-sig") as file:
        rows = list(csv.DictReader(file))
    missing = [c for c in STUDENT_COLUMNS if rows and c not in rows[0]]
    if not rows or missing:
        raise SystemExit(
            f"ddlab grade: {path} is not a Canvas gradebook export (no rows, or without the columns "
            f"{', '.join(missing or STUDENT_COLUMNS)}); export it from Canvas: Grades, Export, Export Entire Gradebook"
        )
    return [r for r in rows if r["Student"].strip() != POINTS_POSSIBLE and r["Student"].strip() != "Student, Test"]


def _row(student: str, roster: list[dict[str, str]]) -> dict[str, str] | None:
    """The student's roster row, found by SIS Login ID, SIS User ID, ID or name; None if not there."""
    for key in ("SIS Login ID", "SIS User ID", "ID", "Student"):
        for row in roster:
            if row[key].strip() == student:
                return row
    return None


def check_roster(students: list[str], roster: list[dict[str, str]]) -> None:
    """SystemExit naming every student not in the roster, and what to do, before any grading."""
    unknown = [student for student in students if _row(student, roster) is None]
    if unknown:
        raise SystemExit(_not_in_roster(unknown))


def _not_in_roster(unknown: list[str]) -> str:
    """What to say of students the roster lacks, and what to do."""
    return (
        f"ddlab grade: not in the roster: {', '.join(map(repr, unknown))} (looked in its SIS Login ID, SIS User "
        "ID, ID and Student columns); name each submission after the student's login, or add them to the roster"
    )


def identity(student: str, roster: list[dict[str, str]] | None) -> dict[str, str]:
    """The five student columns of a student, from the roster (without one: the name as name and login)."""
    if roster is None:
        return {"Student": student, "ID": "", "SIS User ID": "", "SIS Login ID": student, "Section": ""}
    row = _row(student, roster)
    if row is None:
        raise SystemExit(_not_in_roster([student]))
    return {c: row[c] for c in STUDENT_COLUMNS}


def write_canvas(results: list[Result], assignment: str, path: Path, roster: list[dict[str, str]] | None) -> None:
    """One row per student with their points in the column `assignment`, after a Points Possible row."""
    students: dict[str, list[Result]] = {}
    for r in results:
        students.setdefault(r.student, []).append(r)
    possible = max((sum(r.check.points for r in rs) for rs in students.values()), default=0)
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow((*STUDENT_COLUMNS, assignment))
        writer.writerow((POINTS_POSSIBLE, "", "", "", "", possible))
        for student, rs in students.items():
            who = identity(student, roster)
            writer.writerow((*(who[c] for c in STUDENT_COLUMNS), sum(r.points for r in rs)))
