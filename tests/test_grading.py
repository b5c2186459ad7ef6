"""`ddlab grade` on five submissions of lab 03 made here, and how a submission is put together for grading.

The five: the solution; the lab's stub handing in the library's own ring; one that
deadlocks in one exercise and kills its engine in the next (the engines are restarted
after each, the cells that set them up replayed, one printing in two pieces, and grading goes on); one that does one exercise, fakes a check and deletes
another; one whose ring is fitted to the dtypes the notebook's check runs. Graded in one run
of the console script on the grader's draw (`--seed`), as an instructor would, to exactly the
expected sheet, in under 10 minutes, with nothing left running; the solution graded on another
seed here, and on a fresh one by the Gradescope autograder, gets full marks each time.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import nbformat
import numpy as np
import psutil
import pytest
from ddlab.checks._draw import SEED_VARIABLE, Draw
from ddlab.checks.allreduce import _drawn_dtypes
from ddlab.tools.grading.submission import prepare, student_name
from ddlab.tools.labgen import checks

ROOT = Path(__file__).resolve().parents[1]
LAB = nbformat.read(ROOT / "labs" / "03_allreduce.ipynb", as_version=4)
SOLUTION = nbformat.read(ROOT / "solutions" / "03_allreduce.ipynb", as_version=4)
#: The cell timeout of the graded run: above any check of lab 03 (about 10 s each on 2 busy cores).
TIMEOUT = 40

DEADLOCK = """%%px
# Exercise 3.2: allreduce_ring
def allreduce_ring(comm, x):
    incoming = np.empty_like(x)
    MPI.COMM_WORLD.Recv(incoming, source=MPI.ANY_SOURCE)  # the world, not comm: nobody ever sends
    return x + incoming
"""
KILL = """%%px
# Exercise 3.3: allreduce_rabenseifner
import os, signal


def allreduce_rabenseifner(comm, x):
    os.kill(os.getpid(), signal.SIGKILL)
"""
REFERENCE = """%%px
# Exercise 3.2: allreduce_ring
from ddlab.allreduce import allreduce_ring
"""
FAKED = "%%px\nprint('passed: allreduce_ring sums correctly')"
#: What a student who names each MPI datatype writes for the three dtypes the notebook's check prints.
DATATYPES = '    datatype = {"float64": MPI.DOUBLE, "float32": MPI.FLOAT, "int64": MPI.INT64_T}[x.dtype.name]\n'


def fitted(function: str) -> str:
    """The solution of an exercise, fitted to the notebook's dtypes: it looks up the datatype of x's dtype
    among float64, float32 and int64 (a KeyError for any other), as a student sending typed buffers would."""
    source = SOLUTION.cells[exercise_cell(SOLUTION, function)].source
    return source.replace("### BEGIN SOLUTION\n", "### BEGIN SOLUTION\n" + DATATYPES, 1)


def catching_seed(function: str, skip: int = 0) -> int:
    """A seed for the exercise's check: every draw holds a dtype the fitted answer lacks (allreduce's _drawn_dtypes)."""
    drawn = {np.dtype(d) for d in _drawn_dtypes(Draw(80211 + skip, function))}
    assert drawn - {np.dtype(d) for d in (np.float64, np.float32, np.int64)}, drawn
    return 80211 + skip


#: The seed of the graded run of the five (recorded in the sheet): one whose draw catches the fitted ring.
SEED = catching_seed("allreduce_ring")


def exercise_cell(notebook: nbformat.NotebookNode, function: str) -> int:
    return next(i for i, c in enumerate(notebook.cells) if f": {function}\n" in c.source and "%%px" in c.source)


def check_cell(notebook: nbformat.NotebookNode, function: str) -> int:
    return next(i for i, c in enumerate(notebook.cells) if f"check_{function}(" in c.source)


def lab_with(done: tuple[str, ...] = (), **sources: str) -> nbformat.NotebookNode:
    """The lab with the solution's cells for the exercises `done` and the given sources for others."""
    nb = copy.deepcopy(LAB)
    for function in done:
        nb.cells[exercise_cell(nb, function)].source = SOLUTION.cells[exercise_cell(SOLUTION, function)].source
    for function, source in sources.items():
        nb.cells[exercise_cell(nb, function)].source = source
    return nb


def with_progress_prints(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A scratch %%px cell after the first one, printing in two pieces: replayed after a restart, its second
    piece updates the output of the cell the grader runs it as (which must be a code cell)."""
    first = next(i for i, c in enumerate(nb.cells) if c.source.startswith("%%px"))
    progress = (
        "%%px\nimport time\nprint('rank', rank, 'starting', flush=True)\ntime.sleep(1)\nprint('rank', rank, 'ready')"
    )
    nb.cells.insert(first + 1, nbformat.v4.new_code_cell(progress))
    return nb


def faked_checks() -> nbformat.NotebookNode:
    """Exercise 3.1 done; 3.2's check edited into a print of 'passed'; 3.3's check deleted."""
    nb = lab_with(("allreduce_recursive_doubling",))
    nb.cells[check_cell(nb, "allreduce_ring")].source = FAKED
    del nb.cells[check_cell(nb, "allreduce_rabenseifner")]
    return nb


SUBMISSIONS = {
    "solution": lambda: copy.deepcopy(SOLUTION),
    "reference": lambda: lab_with(allreduce_ring=REFERENCE),
    "deadlock_then_kill": lambda: with_progress_prints(
        lab_with(("allreduce_recursive_doubling",), allreduce_ring=DEADLOCK, allreduce_rabenseifner=KILL)
    ),
    "faked_checks": faked_checks,
    "fitted": lambda: lab_with(
        ("allreduce_recursive_doubling", "allreduce_rabenseifner"), allreduce_ring=fitted("allreduce_ring")
    ),
}
P, F, E, T = "passed", "failed", "error", "timed out"
EXPECTED = {  # status of exercises 3.1, 3.2, 3.3
    "solution": (P, P, P),
    "reference": (F, F, F),  # the stubs, and ddlab.allreduce.allreduce_ring: it passes the check, but earns nothing
    "deadlock_then_kill": (P, T, E),  # the engines are restarted after the timeout and after the kill
    "faked_checks": (P, F, F),  # one exercise done; the faked and deleted checks come back from the lab
    "fitted": (
        P,
        F,
        P,
    ),  # the ring passes the notebook's check, not the grader's draw (tests/mpi/test_grading_draws.py)
}
EXERCISES = (
    "Exercise 3.1: allreduce_recursive_doubling",
    "Exercise 3.2: allreduce_ring",
    "Exercise 3.3: allreduce_rabenseifner",
)


def test_checks_come_back_after_their_exercise_whatever_the_student_did():
    notebook, placed, lost = prepare(LAB, faked_checks())
    assert [c.grade_id for c in placed.values()] == [c.grade_id for c in checks(LAB)] and not lost
    for index, check in placed.items():
        assert notebook.cells[index].source == check.source
        assert f"# {check.exercise}: {check.function}" in notebook.cells[index - 1].source
    assert FAKED not in [c.source for c in notebook.cells]
    no_ring = copy.deepcopy(LAB)
    del no_ring.cells[exercise_cell(no_ring, "allreduce_ring")]
    notebook, placed, lost = prepare(LAB, no_ring)
    (ring,) = [i for i, c in placed.items() if c.function == "allreduce_ring"]
    assert "check_allreduce_recursive_doubling" in notebook.cells[ring - 1].source, "goes where the one before went"
    assert lost == {placed[ring].grade_id}


def ring_check_follows(submission: nbformat.NotebookNode) -> str:
    """The source of the cell the ring's check was put after; the check must not be lost."""
    notebook, placed, lost = prepare(LAB, submission)
    (ring,) = [i for i, c in placed.items() if c.function == "allreduce_ring"]
    assert not lost
    return notebook.cells[ring - 1].source


def test_a_check_finds_its_exercise_whose_first_line_the_student_broke():
    body = SOLUTION.cells[exercise_cell(SOLUTION, "allreduce_ring")].source.replace(
        "# Exercise 3.2: allreduce_ring", ""
    )
    broken = lab_with(allreduce_ring=body)  # the first line gone, nbgrader's id still on the cell
    scratch = nbformat.v4.new_code_cell("%%px\nprint('trying things')")
    broken.cells.insert(exercise_cell(LAB, "allreduce_ring") + 1, scratch)
    assert ring_check_follows(broken) == body
    moved = copy.deepcopy(broken)  # the body pasted into a new cell (no id) and the exercise's cell emptied
    moved.cells[exercise_cell(LAB, "allreduce_ring")].source = ""
    moved.cells[exercise_cell(LAB, "allreduce_ring")].metadata = {}
    moved.cells.insert(exercise_cell(LAB, "allreduce_ring") + 2, nbformat.v4.new_code_cell(body))
    assert ring_check_follows(moved) == body, "found by its def"


def test_an_answer_written_below_the_stub_is_the_one_checked():
    body = SOLUTION.cells[exercise_cell(SOLUTION, "allreduce_ring")].source.replace(
        "# Exercise 3.2: allreduce_ring", ""
    )
    below = copy.deepcopy(LAB)  # the stub left as it was, the answer in a new cell after it
    below.cells.insert(exercise_cell(LAB, "allreduce_ring") + 1, nbformat.v4.new_code_cell(body))
    assert ring_check_follows(below) == body


@pytest.mark.parametrize("folder", ["labs", "solutions"])
def test_every_check_of_every_lab_follows_its_exercise_s_last_cell(folder):
    """The lab's (or solution's) own notebook as a submission: each check goes after the last cell whose first
    line names its exercise, none moved by a cell further on that mentions the function."""
    for path in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
        lab = nbformat.read(ROOT / "labs" / path.name, as_version=4)
        notebook, placed, lost = prepare(lab, nbformat.read(path, as_version=4))
        assert not lost, path.name
        for index, check in placed.items():
            previous = max(n for n, c in enumerate(notebook.cells[:index]) if c.cell_type == "code" and n not in placed)
            assert f"# {check.exercise}:" in notebook.cells[previous].source, (path.name, check.exercise)


def test_a_check_that_fails_says_why_its_exercise_may_have_failed():
    from ddlab.tools.grading.run import _note, _outcome

    (ring,) = [c for c in checks(LAB) if c.function == "allreduce_ring"]
    error = nbformat.v4.new_output("error", ename="NameError", evalue="name 'allreduce_ring' is not defined")
    cell = nbformat.v4.new_code_cell(ring.source, outputs=[error])
    status, message = _outcome(ring, cell, True, {"healthy": True}, 40, _note(ring, True, None))
    assert status == "error" and message.startswith("NameError: name 'allreduce_ring' is not defined")
    assert "'# Exercise 3.2: allreduce_ring'" in message and "keep its first line" in message
    syntax = _note(ring, False, "SyntaxError: invalid syntax (<ipython-input>, line 7)")
    assert _outcome(ring, cell, True, {"healthy": True}, 40, syntax)[1].endswith(
        "The exercise's cell raised an error before the check ran: SyntaxError: invalid syntax (<ipython-input>, line 7)"
    )
    assert _note(ring, False, None) == ""


def test_student_names():
    assert student_name(Path("in/alice.ipynb"), "03_allreduce.ipynb") == "alice"
    assert student_name(Path("submitted/bob/lab03/03_allreduce.ipynb"), "03_allreduce.ipynb") == "bob"
    assert student_name(Path("carol/03_allreduce.ipynb"), "03_allreduce.ipynb") == "carol"
    assert student_name(Path("03_allreduce.ipynb"), "03_allreduce.ipynb") == Path.cwd().name != ""


def test_a_file_that_is_no_notebook_is_an_error_for_every_check(tmp_path):
    from ddlab.tools.grading.run import grade

    broken = tmp_path / "broken.ipynb"
    broken.write_text("{ not json")
    results = grade(LAB, broken, "broken", timeout=10)
    assert [(r.status, r.points) for r in results] == [("error", 0)] * 3
    assert "broken.ipynb is not a notebook" in results[0].message


def processes_under(folder: Path) -> list[str]:
    """Every process (kernel, controller, engine, mpiexec) whose IPython directory is in folder."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.environ().get("IPYTHONDIR", "").startswith(str(folder)):
                found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])[:150]}")
        except psutil.Error:
            continue
    return found


#: Canvas's gradebook export for the five, as an instructor downloads it (Grades, Export): a test student too.
ROSTER = (
    ("Lovelace, Ada", "1001", "solution"),
    ("Hopper, Grace", "1002", "reference"),
    ("Turing, Alan", "1003", "deadlock_then_kill"),
    ("Liskov, Barbara", "1004", "faked_checks"),
    ("Hamilton, Margaret", "1005", "fitted"),
)
CANVAS_EXPORT = "Student,ID,SIS User ID,SIS Login ID,Section,Lab 02 (77)\n" + "\n".join(
    [
        "    Points Possible,,,,,4",
        *(f'"{n}",{i},S{i},{login},MPI 101,4' for n, i, login in ROSTER),
        '"Student, Test",9,,,,',
    ]
)
#: The student columns Canvas's gradebook import reads, in order, before one column per assignment.
CANVAS_STUDENT_COLUMNS = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]


def parse_canvas_import(text: str) -> tuple[dict[str, float], list[dict]]:
    """Read a CSV as Canvas's gradebook import documents it: ({assignment: points possible}, student rows).

    The header starts with the five student columns; a row whose Student is "Points Possible" gives
    the maxima; every other row is a student, identified by ID, SIS User ID or SIS Login ID, with a
    number (or nothing) per assignment.
    """
    header, *rows = list(csv.reader(io.StringIO(text)))
    assert header[:5] == CANVAS_STUDENT_COLUMNS, header
    assignments = header[5:]
    assert assignments and all(assignments), "one named column per assignment"
    possible, students = {}, []
    for row in rows:
        assert len(row) == len(header), row
        record = dict(zip(header, row))
        if record["Student"].strip() == "Points Possible":
            possible = {a: float(record[a]) for a in assignments}
            continue
        assert record["ID"] or record["SIS User ID"] or record["SIS Login ID"], f"Canvas cannot match {row}"
        students.append({**record, **{a: float(record[a]) if record[a] else None for a in assignments}})
    return possible, students


def test_the_canvas_file_without_a_roster_names_students_by_login_and_refuses_unknown_ones(tmp_path):
    from ddlab.tools.grading.canvas import check_roster, read_roster, write_canvas
    from ddlab.tools.grading.run import Result

    lab_checks = checks(LAB)
    results = [Result("alice", c, P if i == 0 else F, c.points if i == 0 else 0, "") for i, c in enumerate(lab_checks)]
    write_canvas(results, "Lab 3: allreduce", tmp_path / "canvas.csv", roster=None)
    possible, rows = parse_canvas_import((tmp_path / "canvas.csv").read_text())
    assert possible == {"Lab 3: allreduce": 3.0}
    assert [(r["Student"], r["SIS Login ID"], r["Lab 3: allreduce"]) for r in rows] == [("alice", "alice", 1.0)]
    (tmp_path / "export.csv").write_text(CANVAS_EXPORT)
    roster = read_roster(tmp_path / "export.csv")
    assert [r["SIS Login ID"] for r in roster] == [login for _, _, login in ROSTER]
    with pytest.raises(SystemExit, match="not in the roster: 'alice'"):
        write_canvas(results, "Lab 3", tmp_path / "again.csv", roster)
    with pytest.raises(SystemExit, match="not in the roster: 'alice', 'bob' "):  # every one named at once
        check_roster(["solution", "alice", "fitted", "bob"], roster)
    (tmp_path / "other.csv").write_text("name,score\nalice,3\n")
    with pytest.raises(SystemExit, match="is not a Canvas gradebook export"):
        read_roster(tmp_path / "other.csv")


def test_grade_five_submissions_of_lab_03(tmp_path):
    folder = tmp_path / "collected"
    folder.mkdir()
    paths = []
    for student, make in SUBMISSIONS.items():
        nbformat.write(make(), folder / f"{student}.ipynb")
        paths.append(str(folder / f"{student}.ipynb"))
    ddlab = Path(sys.executable).parent / "ddlab"
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the grader's private IPython directory goes here
    started = time.monotonic()
    roster = tmp_path / "canvas_export.csv"
    roster.write_text(CANVAS_EXPORT)
    canvas = tmp_path / "canvas.csv"
    done = subprocess.run(
        [
            str(ddlab),
            "grade",
            "--lab",
            "03",
            "--seed",
            str(SEED),
            "--timeout",
            str(TIMEOUT),
            "--out",
            str(tmp_path / "grades"),
            "--canvas",
            str(canvas),
            "--roster",
            str(roster),
            *paths,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    elapsed = time.monotonic() - started
    print(done.stdout, f"graded {len(paths)} submissions in {elapsed:.0f} s")
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "grades" / "grades.csv", newline="") as file:
        sheet = list(csv.DictReader(file))
    expected = [
        {
            "student": student,
            "exercise": exercise,
            "status": status,
            "points": str(int(status == P)),
            "max_points": "1",
            "seed": str(SEED),
        }
        for student, statuses in EXPECTED.items()
        for exercise, status in zip(EXERCISES, statuses)
    ]
    assert sheet == expected, done.stdout + done.stderr
    assert elapsed < 600, f"grading took {elapsed:.0f} s"
    assert not processes_under(tmp_path), processes_under(tmp_path)

    points_possible, rows = parse_canvas_import(canvas.read_text())
    assert points_possible == {"03_allreduce": 3.0}
    assert [(r["Student"], r["ID"], r["SIS Login ID"], r["Section"], r["03_allreduce"]) for r in rows] == [
        (name, canvas_id, login, "MPI 101", float(sum(s == P for s in EXPECTED[login])))
        for name, canvas_id, login in ROSTER
    ]

    feedback = {student: (tmp_path / "grades" / "feedback" / f"{student}.html").read_text() for student in EXPECTED}
    assert "3 of 3 points" in feedback["solution"] and "sums correctly" in feedback["solution"]
    assert f"cases the grader drew (seed {SEED})" in feedback["solution"]
    assert "KeyError" in feedback["fitted"] and "allreduce_ring on P=" in feedback["fitted"], "the drawn case named"
    assert "(int32), data seed" in feedback["fitted"] or "(int16), data seed" in feedback["fitted"]
    assert "Exercise 3.1 (allreduce_recursive_doubling) is not done yet" in feedback["reference"]
    assert "ddlab.allreduce.allreduce_ring, the library&#x27;s reference" in feedback["reference"]
    assert f"did not finish within {TIMEOUT} s" in feedback["deadlock_then_kill"]
    assert "The engines died or stopped answering" in feedback["deadlock_then_kill"]
    assert "Exercise 3.2 (allreduce_ring) is not done yet" in feedback["faked_checks"]


def grade_with_seed(tmp_path: Path, seed: int, submissions: dict[str, nbformat.NotebookNode]) -> list[dict]:
    """`ddlab grade --seed SEED` on the submissions, in a folder of tmp_path of their own: the sheet's rows."""
    folder = tmp_path / f"seed-{seed}"
    folder.mkdir()
    for student, notebook in submissions.items():
        nbformat.write(notebook, folder / f"{student}.ipynb")
    command = [str(Path(sys.executable).parent / "ddlab"), "grade", "--lab", "03", "--seed", str(seed)]
    command += [
        "--timeout",
        str(TIMEOUT),
        "--out",
        str(folder / "grades"),
        *(str(folder / f"{s}.ipynb") for s in submissions),
    ]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop(SEED_VARIABLE, None)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"grading on the cases drawn from seed {seed}" in done.stdout
    with open(folder / "grades" / "grades.csv", newline="") as file:
        return list(csv.DictReader(file))


def test_a_right_answer_gets_full_marks_under_another_seed(tmp_path):
    """The solution graded on another seed's draw than test_grade_five_submissions_of_lab_03's (and the
    Gradescope test's, drawn afresh each run): 3 of 3 each time."""
    sheet = grade_with_seed(tmp_path, 31337, {"solution": copy.deepcopy(SOLUTION)})
    assert [(row["status"], row["seed"]) for row in sheet] == [(P, "31337")] * 3, sheet
    assert not processes_under(tmp_path), processes_under(tmp_path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lab", "99"], "no lab '99'"),
        (["--lab", "03"], "no such notebook"),
        (["--lab", "03", "--seed", "-1"], "--seed -1 is negative"),
    ],
)
def test_bad_arguments_are_refused_clearly(tmp_path, args, message):
    from ddlab.tools.cli import main

    with pytest.raises(SystemExit, match=message):
        main(["grade", *args, str(tmp_path / "missing.ipynb")])


NBGRADER = Path(sys.executable).parent / "nbgrader"
NBGRADER_CONFIG = """c = get_config()
c.CourseDirectory.course_id = "ddlab"
c.ClearSolutions.enabled = False  # labs/ are stubbed already (ddlab.tools.labgen): release them as they are
c.Execute.timeout = 300
"""


def test_nbgrader_releases_autogrades_and_gives_feedback_on_a_lab(tmp_path):
    """nbgrader itself on lab 03: generate_assignment, autograde of one submission, generate_feedback.

    The submission did exercise 3.1, edited 3.2's check into a print of 'passed', and fitted 3.3 to
    the notebook's dtypes: nbgrader puts the locked check back, and autograde, run with the grader's
    seed in its environment, reaches the engines with it: 3.3 fails on a drawn dtype, so 1 of 3 points.
    """
    if not NBGRADER.exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true, so nbgrader must be installed (it is in lib[test]), but it is not")
        pytest.skip("nbgrader is not installed: it is in lib[test]; run `make setup`")
    from nbgrader.api import Gradebook

    course = tmp_path / "course"
    (course / "source" / "lab03").mkdir(parents=True)
    (course / "nbgrader_config.py").write_text(NBGRADER_CONFIG)
    nbformat.write(LAB, course / "source" / "lab03" / "03_allreduce.ipynb")
    seed = catching_seed("allreduce_rabenseifner")
    env = {
        **os.environ,
        "PATH": f"{NBGRADER.parent}{os.pathsep}{os.environ['PATH']}",  # nbgrader runs alembic
        "IPYTHONDIR": str(tmp_path / "ipython"),  # the kernel's clusters, told apart from the rest
    }

    def nbgrader(*args: str) -> str:
        graded = {**env, SEED_VARIABLE: str(seed)} if args[0] == "autograde" else env
        done = subprocess.run(
            [str(NBGRADER), *args], cwd=course, env=graded, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"nbgrader {' '.join(args)}:\n{done.stdout}{done.stderr}"
        return done.stdout + done.stderr

    nbgrader("generate_assignment", "lab03", "--force")
    released = nbformat.read(course / "release" / "lab03" / "03_allreduce.ipynb", as_version=4)
    assert released.cells[check_cell(released, "allreduce_ring")].metadata.editable is False
    submission = copy.deepcopy(released)
    done = exercise_cell(submission, "allreduce_recursive_doubling")
    submission.cells[done].source = SOLUTION.cells[exercise_cell(SOLUTION, "allreduce_recursive_doubling")].source
    submission.cells[check_cell(submission, "allreduce_ring")].source = FAKED
    submission.cells[exercise_cell(submission, "allreduce_rabenseifner")].source = fitted("allreduce_rabenseifner")
    (course / "submitted" / "alice" / "lab03").mkdir(parents=True)
    nbformat.write(submission, course / "submitted" / "alice" / "lab03" / "03_allreduce.ipynb")
    nbgrader("autograde", "lab03", "--create", "--force")
    nbgrader("generate_feedback", "lab03", "--force")

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        scores = {
            check.grade_id: gradebook.find_grade(check.grade_id, "03_allreduce", "lab03", "alice").score
            for check in checks(LAB)
        }
    assert scores == {
        "check_ex3_1_allreduce_recursive_doubling": 1,
        "check_ex3_2_allreduce_ring": 0,
        "check_ex3_3_allreduce_rabenseifner": 0,
    }
    feedback = (course / "feedback" / "alice" / "lab03" / "03_allreduce.html").read_text()
    assert "Score: 1.0 / 3.0" in feedback and "Exercise 3.2 (allreduce_ring) is not done yet" in feedback
    assert "KeyError" in feedback and f"seed {seed}" in feedback, "3.3 failed on the grader's draw, named"
    assert not processes_under(tmp_path), processes_under(tmp_path)


def gradescope_run(autograder: zipfile.ZipFile, root: Path, notebook: nbformat.NotebookNode) -> dict:
    """Run the autograder as Gradescope does, in `root` laid out as /autograder: its results.json.

    source/ is the unpacked archive, run_autograder its copy at the top, submission/ the upload,
    venv/ what setup.sh builds (here: this suite's environment, where ddlab is installed already).
    """
    autograder.extractall(root / "source")
    for name in ("run_autograder", "setup.sh"):
        (root / "source" / name).chmod(0o755)  # zipfile does not restore modes: Gradescope's unzip does
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    (root / "venv").symlink_to(Path(sys.prefix))
    (root / "submission").mkdir()
    nbformat.write(notebook, root / "submission" / "03_allreduce.ipynb")
    env = {**os.environ, "TMPDIR": str(root)}  # the grader's private IPython directory goes here
    done = subprocess.run(
        [str(root / "run_autograder")], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not processes_under(root), processes_under(root)
    return json.loads((root / "results" / "results.json").read_text())


def test_the_gradescope_autograder_gives_full_zero_and_partial_marks(tmp_path):
    ddlab = Path(sys.executable).parent / "ddlab"
    archive = tmp_path / "autograder.zip"
    done = subprocess.run(
        [str(ddlab), "grade", "--lab", "03", "--timeout", str(TIMEOUT), "--gradescope", str(archive)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with zipfile.ZipFile(archive) as autograder:
        names = set(autograder.namelist())
        assert {"setup.sh", "run_autograder", "labs/03_allreduce.ipynb", "lib/pyproject.toml"} <= names
        assert {"lib/ddlab/checks/allreduce.py", "clusters/local/ipcluster_config.py"} <= names
        assert not [n for n in names if "__pycache__" in n or ".egg-info" in n]
        assert autograder.getinfo("run_autograder").external_attr >> 16 & 0o111, "run_autograder is executable"
        assert autograder.read("labs/03_allreduce.ipynb") == (ROOT / "labs" / "03_allreduce.ipynb").read_bytes()
        for script in ("setup.sh", "run_autograder"):
            syntax = subprocess.run(["bash", "-n"], input=autograder.read(script), capture_output=True)
            assert syntax.returncode == 0, syntax.stderr
        graded = {
            name: gradescope_run(autograder, tmp_path / name, make())
            for name, make in (
                ("solution", lambda: copy.deepcopy(SOLUTION)),
                ("stub", lambda: copy.deepcopy(LAB)),
                ("half_done", lambda: lab_with(("allreduce_recursive_doubling",))),
            )
        }
    names = [t["name"] for t in graded["solution"]["tests"]]
    assert names == list(EXERCISES), "one test per check, in the lab's order"
    assert [t["max_score"] for t in graded["solution"]["tests"]] == [c.points for c in checks(LAB)]
    assert {name: results["score"] for name, results in graded.items()} == {"solution": 3, "stub": 0, "half_done": 1}
    assert "on cases the grader drew (seed " in graded["solution"]["output"], "each run draws a seed, recorded"
    assert [t["status"] for t in graded["half_done"]["tests"]] == ["passed", "failed", "failed"]
    assert "is not done yet" in graded["stub"]["tests"][0]["output"]


def test_the_gradescope_autograder_says_what_to_upload_when_no_notebook_came(tmp_path):
    from ddlab.tools.grading.gradescope import main

    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "notes.txt").write_text("forgot the notebook")
    results = tmp_path / "results" / "results.json"
    args = ["--lab", str(ROOT / "labs" / "03_allreduce.ipynb"), "--submission", str(tmp_path / "submission")]
    assert main([*args, "--results", str(results)]) == 0
    graded = json.loads(results.read_text())
    assert graded["score"] == 0 and [t["score"] for t in graded["tests"]] == [0, 0, 0]
    assert "upload exactly one notebook, 03_allreduce.ipynb" in graded["output"]


def test_an_engines_error_is_named_not_ipyparallel_s_count_of_them():
    from ddlab.tools.grading.run import _outcome, _raised

    text = "AlreadyDisplayedError: 4 errors\n[2:execute]\nZeroDivisionError: division by zero"
    assert _raised(text) == ("ZeroDivisionError", "division by zero")
    assert _raised("AlreadyDisplayedError: 4 errors") == ("AlreadyDisplayedError", "4 errors")
    (ring,) = [c for c in checks(LAB) if c.function == "allreduce_ring"]
    summary = nbformat.v4.new_output("error", ename="AlreadyDisplayedError", evalue="4 errors", traceback=[])
    cell = nbformat.v4.new_code_cell(ring.source, outputs=[summary])
    status, message = _outcome(ring, cell, True, {"healthy": False, "problem": "rank 2 exited with code 9"}, 40)
    assert (status, message) == (
        "error",
        "The engines died or stopped answering during this check (rank 2 exited with code 9); they were restarted.",
    )
