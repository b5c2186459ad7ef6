"""`ddlab grade --lab 03 SUBMISSIONS...`: grade collected notebooks into a CSV sheet and HTML feedback.

`--canvas FILE` also writes the grades as a CSV that Canvas's gradebook imports (`canvas`);
`ddlab grade --lab 03 --gradescope autograder.zip` writes the lab's Gradescope autograder
instead of grading (`gradescope`).
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path

import nbformat

from ...runtime.cluster import CLUSTERS_DIR
from .canvas import check_roster, read_roster, write_canvas
from .gradescope import write_autograder
from .report import feedback_html, write_sheet
from .run import clean_up, grade, private_ipython_dir
from .submission import student_name

LABS_DIR = CLUSTERS_DIR.parent / "labs"


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `grade` subcommand of `ddlab`."""
    parser = commands.add_parser("grade", help="grade submitted lab notebooks: a CSV grade sheet and HTML feedback")
    parser.add_argument("--lab", required=True, help="the lab's number, e.g. 03")
    parser.add_argument("submissions", nargs="*", type=Path, help="the students' notebooks (.ipynb)")
    parser.add_argument("--labs", type=Path, default=LABS_DIR, help=f"where the labs are (default {LABS_DIR})")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("grades"),
        help="folder for grades.csv and feedback/STUDENT.html (default ./grades)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a cell may run before it counts as timed out (default 300)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="the seed of the checks' cases (sizes, dtypes, ranks, data), recorded in grades.csv; "
        "default: a new one, printed (pass it again to grade the same cases)",
    )
    parser.add_argument(
        "--canvas", type=Path, help="also write the points as a CSV for Canvas's gradebook import (Grades, Import)"
    )
    parser.add_argument(
        "--roster", type=Path, help="Canvas's gradebook export, whose IDs and sections the --canvas file takes"
    )
    parser.add_argument("--assignment", help="the Canvas assignment's column (default: the lab, e.g. 03_allreduce)")
    parser.add_argument(
        "--gradescope",
        type=Path,
        help="write the lab's Gradescope autograder (a zip to upload) to this path instead of grading",
    )


def find_lab(labs: Path, number: str) -> Path:
    """labs/NN_*.ipynb for the lab number; SystemExit saying what exists if there is none."""
    found = sorted(labs.glob(f"{int(number):02d}_*.ipynb")) if number.isdigit() else []
    if len(found) != 1:
        known = ", ".join(p.name for p in sorted(labs.glob("[0-9][0-9]_*.ipynb"))) or "none"
        raise SystemExit(
            f"ddlab grade: no lab {number!r} in {labs} (labs there: {known}); pass --labs DIR if elsewhere"
        )
    return found[0]


def main(args: argparse.Namespace) -> int:
    """Grade every submission in turn, each on a clean cluster; exit status 1 if processes had to be killed."""
    lab_path = find_lab(args.labs, args.lab)
    if args.seed is not None and args.seed < 0:
        raise SystemExit(f"ddlab grade: --seed {args.seed} is negative: give a whole number of 0 or more")
    if args.gradescope is not None:
        names = write_autograder(lab_path, args.gradescope, args.timeout, args.seed)
        print(f"wrote {args.gradescope} ({len(names)} files): upload it as the assignment's autograder in Gradescope")
        return 0
    if not args.submissions:
        raise SystemExit(
            "ddlab grade: give the submitted notebooks to grade, or --gradescope ZIP to export the autograder"
        )
    roster = read_roster(args.roster) if args.roster is not None else None
    if args.canvas is not None and roster is not None:  # refuse unknown students before grading
        check_roster([student_name(path, lab_path.name) for path in args.submissions], roster)
    lab = nbformat.read(lab_path, as_version=4)
    missing = [str(p) for p in args.submissions if not p.is_file()]
    if missing:
        raise SystemExit(f"ddlab grade: no such notebook: {', '.join(missing)}")
    seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    print(f"grading on the cases drawn from seed {seed} (ddlab grade --seed {seed} draws them again)", flush=True)
    feedback = args.out / "feedback"
    feedback.mkdir(parents=True, exist_ok=True)
    results, survivors = [], []
    with private_ipython_dir() as ipython_dir:
        for path in args.submissions:
            student, started = student_name(path, lab_path.name), time.monotonic()
            graded = grade(lab, path, student, args.timeout, seed)
            survivors += clean_up(ipython_dir)
            results += graded
            (feedback / f"{student}.html").write_text(feedback_html(student, lab_path.stem, graded))
            points = sum(r.points for r in graded)
            print(
                f"{student}: {points} of {sum(r.check.points for r in graded)} points "
                f"({', '.join(r.status for r in graded)}) in {time.monotonic() - started:.0f} s",
                flush=True,
            )
    write_sheet(results, args.out / "grades.csv")
    print(f"wrote {args.out / 'grades.csv'} and {feedback}/")
    if args.canvas is not None:
        write_canvas(results, args.assignment or lab_path.stem, args.canvas, roster)
        print(f"wrote {args.canvas}: import it in Canvas (Grades, Import)")
    for line in survivors:
        print(f"killed a leftover process: {line}", file=sys.stderr)
    return 1 if survivors else 0
