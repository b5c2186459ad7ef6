"""Every lab's solution graded on the grader's draws: full marks under every seed, as a right answer must get.

For each notebook of solutions/ (or the labs named) and each seed it runs `ddlab grade --lab NN --seed S` on the
solution, as an instructor grades a submission (fresh engines, every check cell on the cases the seed draws), and
prints the points, the seconds and every check that lost points with its status. The suite runs each lab's own
cases; this is where every converted check meets drawn sizes, dtypes, ranks and data on the course's own answers.
About 5 minutes a seed for all twenty labs on 2 cores (15 minutes for three seeds, nothing else running).

    .venv/bin/python bench/grade_solutions.py [--seeds 11,2027,90210] [labs ...]   # e.g. 03 13
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def grade(notebook: Path, seed: int, timeout: int) -> tuple[list[dict[str, str]], float]:
    """The grade sheet's rows of one solution graded on one seed's draw, and the seconds it took."""
    lab = notebook.name[:2]
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "ddlab.tools.cli", "grade", "--lab", lab, "--seed", str(seed), "--out", out]
            + ["--timeout", str(timeout), str(notebook)],
            check=True,
            capture_output=True,
            text=True,
        )
        took = time.perf_counter() - start
        with (Path(out) / "grades.csv").open() as file:
            return list(csv.DictReader(file)), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", help="two-digit lab numbers (default: every solution)")
    parser.add_argument(
        "--seeds", type=lambda text: [int(s) for s in text.split(",")], default=[11, 2027, 90210], help="e.g. 11,2027"
    )
    parser.add_argument("--timeout", type=int, default=600, help="seconds a cell may run")
    args = parser.parse_args()
    notebooks = sorted(
        p for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb") if not args.labs or p.name[:2] in args.labs
    )
    lost = []
    for notebook in notebooks:
        for seed in args.seeds:
            rows, took = grade(notebook, seed, args.timeout)
            points = sum(float(r["points"]) for r in rows)
            most = sum(float(r["max_points"]) for r in rows)
            drawn = {r["seed"] for r in rows}
            print(
                f"{notebook.stem:32} seed {seed:6d}: {points:g} of {most:g} points, {len(rows)} checks, {took:.0f} s",
                flush=True,
            )
            if drawn != {str(seed)}:
                lost.append(f"{notebook.stem} seed {seed}: the sheet records seeds {sorted(drawn)}")
            lost += [
                f"{notebook.stem} seed {seed}: {r['exercise']} {r['status']}, {r['points']} of {r['max_points']}"
                for r in rows
                if float(r["points"]) < float(r["max_points"])
            ]
    for line in lost:
        print(f"  lost: {line}")
    ok = not lost and bool(notebooks)
    print(
        f"verdict: {len(notebooks)} solutions x {len(args.seeds)} seeds, every check full marks: {'met' if ok else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
