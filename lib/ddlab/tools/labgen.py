"""Generate the student notebooks in labs/ from the solved ones in solutions/.

In a solution notebook, exercise code sits between `### BEGIN SOLUTION` and
`### END SOLUTION` in a code cell whose comment `# Exercise N.M: name` says which
exercise it is. The lab gets a stub there that raises NotImplementedError naming
the exercise. Cells tagged `check` must then fail in the lab: they get nbval's
`raises-exception` tag, and the notebook tests demand that they really raise.
Cells tagged `needs-solution` use an exercise's result and may fail in the lab.

The lab also carries nbgrader's cell metadata, so a course run with nbgrader can
release, collect and autograde it: exercise cells are solution cells, check cells
autograded test cells worth POINTS each. Their grade ids come from the exercise
label ("Exercise 3.2: allreduce_ring" gives `ex3_2_allreduce_ring` and
`check_ex3_2_allreduce_ring`), so they stay the same each time labs/ is generated.

    python -m ddlab.tools.labgen solutions labs          # write labs/
    python -m ddlab.tools.labgen solutions labs --check  # exit 1 if labs/ is stale
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CHECK_TAG, NEEDS_TAG, RAISES_TAG = "check", "needs-solution", "raises-exception"
EXERCISE_RE = re.compile(r"^\s*#\s*(Exercise\s+[\w.]+)\s*:\s*(.+?)\s*$", re.MULTILINE)
#: What each check cell is worth, in nbgrader and in `ddlab grade`.
POINTS = 1


class LabSourceError(ValueError):
    """A solution notebook breaks the conventions above; the message says where."""


def stub_source(source: str, where: str) -> tuple[str, int]:
    """Replace each solution block of a cell with a stub; return (new source, stubs made)."""
    label = EXERCISE_RE.search(source)
    lines, out, stubs, inside = source.split("\n"), [], 0, False
    for number, line in enumerate(lines, 1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise LabSourceError(f"{where}, line {number}: {BEGIN} inside a solution block")
            if label is None:
                raise LabSourceError(f"{where}: a solution block needs a '# Exercise N.M: name' comment")
            indent = line[: len(line) - len(line.lstrip())]
            exercise, task = label.groups()
            message = f"{exercise} ({task}) is not done yet: write it where this line is."
            out.append(f"{indent}raise NotImplementedError({message!r})")
            inside, stubs = True, stubs + 1
        elif marker == END:
            if not inside:
                raise LabSourceError(f"{where}, line {number}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise LabSourceError(f"{where}: {BEGIN} is never closed by {END}")
    return "\n".join(out), stubs


@dataclass(frozen=True)
class Check:
    """A check cell of a lab: where it is, its grade id, the exercise it checks, its source."""

    index: int
    grade_id: str
    exercise: str  # "Exercise 3.2"
    function: str  # "allreduce_ring": the name the exercise defines
    source: str
    points: int


def exercise_id(exercise: str, function: str) -> str:
    """nbgrader's grade id of an exercise cell: letters, digits and underscores only."""
    return re.sub(r"\W+", "_", f"ex{exercise.split()[-1]}_{function}").strip("_")


def _nbgrader(grade_id: str, solution: bool, points: int | None = None) -> dict:
    """nbgrader's cell metadata (schema 3) for a solution cell, or an autograded test cell if points."""
    meta = {
        "grade": points is not None,
        "grade_id": grade_id,
        "locked": not solution,
        "schema_version": 3,
        "solution": solution,
        "task": False,
    }
    return meta | ({"points": points} if points is not None else {})


def make_lab(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The lab notebook for one solution notebook: stubs in, outputs out, checks marked."""
    lab = copy.deepcopy(solution)
    label, used = None, set()
    for index, cell in enumerate(lab.cells):
        where = f"{name}, cell {index}"
        tags = list(cell.get("metadata", {}).get("tags", []))
        grade_id, stubs = None, 0
        if cell.cell_type == "code":
            cell.source, stubs = stub_source(cell.source, where)
            cell.outputs, cell.execution_count = [], None
        if stubs:
            label = EXERCISE_RE.search(solution.cells[index].source).groups()  # type: ignore[union-attr]
            grade_id = exercise_id(*label)
        if CHECK_TAG in tags:
            if label is None:
                raise LabSourceError(f"{where}: a check cell with no exercise before it checks nothing")
            grade_id = "check_" + exercise_id(*label)
        if grade_id is not None:
            base, count = grade_id, 1
            while grade_id in used:  # a second cell of one exercise, or a second check of it
                count += 1
                grade_id = f"{base}_{count}"
            used.add(grade_id)
            cell.metadata["nbgrader"] = _nbgrader(
                grade_id, CHECK_TAG not in tags, POINTS if CHECK_TAG in tags else None
            )
        if (CHECK_TAG in tags or NEEDS_TAG in tags) and RAISES_TAG not in tags:
            tags.append(RAISES_TAG)
        if tags:
            cell.metadata["tags"] = tags
    return lab


def checks(lab: nbformat.NotebookNode) -> list[Check]:
    """The check cells of a generated lab, each with the exercise it checks."""
    found, label = [], None
    for index, cell in enumerate(lab.cells):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("solution"):
            label = EXERCISE_RE.search(cell.source).groups()  # type: ignore[union-attr]
        if meta.get("grade") and label is not None:
            found.append(Check(index, meta["grade_id"], label[0], label[1], cell.source, meta["points"]))
    return found


def render(notebook: nbformat.NotebookNode) -> str:
    """A notebook as the text written to disk (stable, so labs/ can be compared)."""
    return nbformat.writes(notebook) + "\n"


def generate(solutions: Path, labs: Path) -> dict[Path, str]:
    """Map each lab path to the text it should have."""
    wanted = {}
    for path in sorted(solutions.glob("[0-9][0-9]_*.ipynb")):
        solution = nbformat.read(path, as_version=4)
        wanted[labs / path.name] = render(make_lab(solution, path.name))
    return wanted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddlab.tools.labgen", description=__doc__.split("\n")[0])
    parser.add_argument("solutions", type=Path)
    parser.add_argument("labs", type=Path)
    parser.add_argument("--check", action="store_true", help="only report whether labs/ is up to date")
    args = parser.parse_args(argv)
    wanted = generate(args.solutions, args.labs)
    existing = set(args.labs.glob("[0-9][0-9]_*.ipynb"))
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    extra = sorted(existing - set(wanted))
    if args.check:
        for path in stale + extra:
            print(f"out of date: {path} (run `make labs`)")
        return 1 if stale or extra else 0
    args.labs.mkdir(parents=True, exist_ok=True)
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path}")
    for path in extra:
        path.unlink()
        print(f"removed {path} (no solution notebook)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
