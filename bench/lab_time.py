"""How long each lab takes a student: what the first cell's "Time:" line is based on.

For every notebook in solutions/ it measures what a student has to do:
- read: the words of its explanations (markdown outside hints) and of its hints;
- write: its exercises and the lines of their solutions (code lines between the
  solution markers, blank lines and comments not counted; an exercise's blocks, in one
  cell or several, count as one exercise);
- wait: with --run, the seconds its cells take when run top to bottom (Run All, on a
  fresh cluster of this machine's engines, in a private IPython directory).
It prints these, the estimate they give at the rates below, and the time the lab's first
cell states.

The rates were fitted (least squares of the relative error) to walkthroughs of labs 00-07,
in which reviewers solved each lab from its student version as a new student would,
counting attempts and judging each exercise's minutes (docs/teaching.md, "How long each lab takes"):
a first reading of technical prose with formulas and figures at 120 words a minute, half
the hints read, per exercise 2 minutes plus 0.75 per solution line, cells run twice, and
10 minutes per lab for starting the engines, restarts and looking around.

    .venv/bin/python bench/lab_time.py [--run] [labs ...]   # e.g. 03 04
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE = 120
HINTS_READ = 0.5
MINUTES_PER_EXERCISE = 2.0
MINUTES_PER_LINE = 0.75
RUNS = 2
FIXED_MINUTES = 10.0
HINT_RE = re.compile(r"<details>.*?</details>", re.DOTALL)
SOLUTION_RE = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.DOTALL)
EXERCISE_RE = re.compile(r"#\s*Exercise\s+(\d+\.\d+)")
STATED_RE = re.compile(r"\*\*Time:\*\*\s*about (\d+) minutes")


@dataclass
class Lab:
    """What one lab asks of a student."""

    name: str
    words: int
    hint_words: int
    lines: list[int]
    stated: int | None
    seconds: float | None = None

    def minutes(self) -> float:
        """The estimate at the module's rates (running time counts only if measured)."""
        reading = (self.words + HINTS_READ * self.hint_words) / WORDS_PER_MINUTE
        writing = MINUTES_PER_EXERCISE * len(self.lines) + MINUTES_PER_LINE * sum(self.lines)
        return FIXED_MINUTES + reading + writing + RUNS * (self.seconds or 0.0) / 60


def measure(path: Path) -> Lab:
    """Words, hint words and solution lines of one solution notebook, and its stated time."""
    nb = nbformat.read(path, as_version=4)
    words = hint_words = 0
    lines: dict[str, int] = {}  # solution lines per exercise (an exercise may span cells and blocks)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            hints = sum(len(h.split()) for h in HINT_RE.findall(cell.source))
            hint_words += hints
            words += len(cell.source.split()) - hints
        if cell.cell_type != "code" or not SOLUTION_RE.search(cell.source):
            continue
        exercise = EXERCISE_RE.search(cell.source)
        if exercise is None:
            raise ValueError(f"{path.name}: a cell with a solution does not name its exercise ('# Exercise N.M')")
        solved = sum(
            1
            for block in SOLUTION_RE.findall(cell.source)
            for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")
        )
        lines[exercise.group(1)] = lines.get(exercise.group(1), 0) + solved
    stated = STATED_RE.search(nb.cells[0].source) if nb.cells else None
    return Lab(path.stem, words, hint_words, list(lines.values()), int(stated.group(1)) if stated else None)


def run_seconds(path: Path, timeout: int = 600) -> float:
    """Seconds to run the notebook top to bottom in the course kernel; raise if a cell fails."""
    from ddlab.tools.grading.run import KERNEL, clean_up, kernel_config, private_ipython_dir
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    with private_ipython_dir() as ipython_dir:
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name=KERNEL,
            config=kernel_config(ipython_dir),
            resources={"metadata": {"path": str(path.parent)}},
        )
        start = time.monotonic()
        try:
            client.execute()  # the notebook's last cell stops its cluster
        finally:
            seconds = time.monotonic() - start
            clean_up(ipython_dir)  # and if a cell failed first, this does
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("labs", nargs="*", help="lab numbers (default: all)")
    parser.add_argument("--run", action="store_true", help="also run each solution notebook and time it")
    args = parser.parse_args()
    paths = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
    paths = [p for p in paths if not args.labs or p.name[:2] in args.labs]
    if not paths:
        parser.error(f"no lab numbered {' or '.join(args.labs)} in solutions/")
    print(
        f"rates: {WORDS_PER_MINUTE} words/min, half the hints read, {MINUTES_PER_EXERCISE:g} min per exercise "
        f"+ {MINUTES_PER_LINE:g} min per solution line, cells run {RUNS}x, {FIXED_MINUTES:g} min per lab"
    )
    print(
        f"{'lab':<28}{'words':>7}{'hints':>7}  {'solution lines per exercise':<28}{'run s':>7}{'estimate':>10}{'stated':>8}"
    )
    for path in paths:
        lab = measure(path)
        if args.run:
            lab.seconds = run_seconds(path)
        run = f"{lab.seconds:.0f}" if lab.seconds is not None else "-"
        print(
            f"{lab.name:<28}{lab.words:>7}{lab.hint_words:>7}  {lab.lines!s:<28}{run:>7}"
            f"{lab.minutes():>8.0f} m{lab.stated or '-':>7} m",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
