"""The grade sheet (CSV, one row per student and check) and one HTML feedback page per student."""

from __future__ import annotations

import csv
import html
from pathlib import Path

from .run import Result

COLUMNS = ("student", "exercise", "status", "points", "max_points", "seed")


def write_sheet(results: list[Result], path: Path) -> None:
    """student, exercise ("Exercise 3.2: allreduce_ring"), status, points, max_points, seed (the draw's; empty: none)."""
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(COLUMNS)
        for r in results:
            row = (r.student, f"{r.check.exercise}: {r.check.function}", r.status, r.points, r.check.points)
            writer.writerow((*row, "" if r.seed is None else r.seed))


def feedback_html(student: str, lab: str, results: list[Result]) -> str:
    """A page for one student: their points, and each check's status and message."""
    total, most = sum(r.points for r in results), sum(r.check.points for r in results)
    seeds = {r.seed for r in results if r.seed is not None}
    drawn = (
        f" The checks ran on cases the grader drew (seed {', '.join(map(str, sorted(seeds)))}): sizes, dtypes, "
        "ranks and data the notebook does not show."
        if seeds
        else ""
    )
    rows = "\n".join(
        f'<tr class="{r.status.replace(" ", "-")}"><td>{html.escape(r.check.exercise)}: '
        f"<code>{html.escape(r.check.function)}</code></td><td>{r.status}</td><td>{r.points} / {r.check.points}</td>"
        f"<td><pre>{html.escape(r.message)}</pre></td></tr>"
        for r in results
    )
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(lab)}: feedback for {html.escape(student)}</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{border:1px solid #ccc;padding:.4em;vertical-align:top}}
table{{border-collapse:collapse}} pre{{white-space:pre-wrap;margin:0}} .passed{{background:#e8f5e9}}
.failed{{background:#fff3e0}} .error,.timed-out{{background:#ffebee}}</style></head>
<body><h1>{html.escape(lab)}: {html.escape(student)}</h1>
<p>{total} of {most} points. Each check ran on fresh MPI engines, as the lab's own check cell.{drawn}</p>
<table><tr><th>exercise</th><th>status</th><th>points</th><th>what the check said</th></tr>
{rows}
</table></body></html>
"""
