"""Generate the student notebooks in labs/ from the solved ones in solutions/.

In a solution notebook, exercise code sits between `### BEGIN SOLUTION` and
`### END SOLUTION` in a code cell whose comment `# Exercise N.M: name` says which
exercise it is. The lab gets a stub there that raises NotImplementedError naming
the exercise. Cells tagged `check` must then fail in the lab: they get nbval's
`raises-exception` tag, and the notebook tests demand that they really raise.
Cells tagged `needs-solution` use an exercise's result and may fail in the lab.

    python -m ddlab.labgen solutions labs          # write labs/
    python -m ddlab.labgen solutions labs --check  # exit 1 if labs/ is stale
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CHECK_TAG, NEEDS_TAG, RAISES_TAG = "check", "needs-solution", "raises-exception"
EXERCISE_RE = re.compile(r"^\s*#\s*(Exercise\s+[\w.]+)\s*:\s*(.+?)\s*$", re.MULTILINE)


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


def make_lab(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The lab notebook for one solution notebook: stubs in, outputs out, checks marked."""
    lab = copy.deepcopy(solution)
    stubs_so_far = 0
    for index, cell in enumerate(lab.cells):
        where = f"{name}, cell {index}"
        tags = list(cell.get("metadata", {}).get("tags", []))
        if cell.cell_type == "code":
            cell.source, stubs = stub_source(cell.source, where)
            stubs_so_far += stubs
            cell.outputs, cell.execution_count = [], None
        if CHECK_TAG in tags and stubs_so_far == 0:
            raise LabSourceError(f"{where}: a check cell with no exercise before it checks nothing")
        if (CHECK_TAG in tags or NEEDS_TAG in tags) and RAISES_TAG not in tags:
            tags.append(RAISES_TAG)
        if tags:
            cell.metadata["tags"] = tags
    return lab


def clear_outputs(notebook: nbformat.NotebookNode) -> bool:
    """Strip outputs and execution counts in place; True if anything was removed."""
    changed = False
    for cell in notebook.cells:
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
            cell.outputs, cell.execution_count, changed = [], None, True
    return changed


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
    parser = argparse.ArgumentParser(prog="python -m ddlab.labgen", description=__doc__.split("\n")[0])
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
