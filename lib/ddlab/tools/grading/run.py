"""Run one submission in the course kernel with nbclient, cell by cell, and grade its checks.

Every cell has a timeout. After each cell the grader asks the engines to answer
(`probe.report`): if a cell timed out (a deadlock) or the engines died, it restarts
them with `ddlab.runtime.cluster.restart()` and replays the %%px cells that had run, so the
later exercises are graded on what the student wrote. Cells after the last check
cannot change a grade and are not run. Each grading run has its own IPython
directory, so its clusters are its own; after each submission any of them still up
is stopped, and a controller, engine or mpiexec that survives that is killed.

With a seed, the kernel (and so its engines) gets it as DDLAB_GRADE_SEED: the checks then run
the grader's draw of sizes, dtypes, ranks and data instead of the notebook's (ddlab.checks._draw).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import nbformat
import psutil
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError
from traitlets.config import Config

from ...checks._draw import SEED_VARIABLE
from ...runtime.cluster import cleanup_orphans
from ..labgen import Check, checks
from .submission import prepare

KERNEL = "ddlab"  # the course kernel, "Python (ddlab)"
RESTART = "import ddlab.runtime.cluster\nddlab.runtime.cluster.restart()"
STOP = "import ddlab.runtime.cluster\nddlab.runtime.cluster.stop()"
TIMED_OUT = "CellTimeoutError"  # the error nbclient reports for a cell it interrupted at the timeout
#: A check's verdict on the student's code (its CheckFailed, or the stub's error): "failed", not "error".
VERDICTS = ("CheckFailed", "NotImplementedError")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_EXCEPTION = re.compile(r"^(\w+): (.*)$")
_SUMMARIES = ("AlreadyDisplayedError", "CompositeError")  # ipyparallel's: "N errors", the engines' own above or below


@dataclass
class Result:
    """One check of one submission: passed, failed, error or timed out, the points, and why; the draw's seed."""

    student: str
    check: Check
    status: str
    points: int
    message: str
    seed: int | None = None


def _text(cell: nbformat.NotebookNode) -> str:
    """Everything a cell printed or raised, as plain text."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("display_data", "execute_result"):
            parts.append(output.get("data", {}).get("text/plain", ""))
        elif output.output_type == "error":
            parts.append("\n".join(output.traceback) + f"\n{output.ename}: {output.evalue}")
    return _ANSI.sub("", "\n".join(parts))


def _raised(text: str) -> tuple[str, str]:
    """The first exception reported in a cell's text, with its message's lines: (name, message); ipyparallel's
    summaries of the engines' errors ("AlreadyDisplayedError: 4 errors") only if the text names no other."""
    lines = text.splitlines()
    for number, line in enumerate(lines):
        match = _EXCEPTION.match(line)
        if (
            match
            and match.group(1) in _SUMMARIES
            and any(
                (other := _EXCEPTION.match(later)) and other.group(1) not in _SUMMARIES for later in lines[number + 1 :]
            )
        ):
            continue
        if match and (match.group(1).endswith(("Error", "Exception", "Interrupt")) or match.group(1) in VERDICTS):
            rest = []
            for more in lines[number + 1 :]:
                if not more.startswith(" ") or not more.strip():
                    break
                rest.append(more)
            return match.group(1), "\n".join([match.group(2), *rest])
    return "Error", text.strip()[-2000:] or "the cell failed without a message"


def verdict(check: Check, cell: nbformat.NotebookNode, reference: str | None) -> tuple[str, str]:
    """(status, message) of a check cell that ran; `reference` names the library function it was given, if so."""
    text = _text(cell)
    if reference:  # the check refuses it too (ddlab.runtime.reference); this names it by its public name
        return "failed", (
            f"{check.function} is {reference}, the library's reference version, "
            "not your own: write it yourself to get the points."
        )
    if not any(output.output_type == "error" for output in cell.get("outputs", [])):
        said = [line.split("passed:", 1)[1].strip() for line in text.splitlines() if "passed:" in line]
        return "passed", said[0] if said else "the check ran without an error"
    name, message = _raised(text)
    return ("failed" if name in VERDICTS else "error"), f"{name}: {message}"


class _Kernel:
    """The submission's kernel, through nbclient: run cells with a timeout, ask the probe."""

    def __init__(self, client: NotebookClient):
        self.client = client
        self.reply: dict[str, Any] = {}  # the content of the last cell's execute reply
        client.on_cell_executed = self._executed
        # The grader's own cells run as this code cell at the notebook's end: nbclient writes an output that a
        # display updates later (%%px streams them) into the cell at the index it was given, so it must be one.
        self.own = len(client.nb.cells)
        client.nb.cells.append(nbformat.v4.new_code_cell(""))

    def _executed(self, cell: nbformat.NotebookNode, cell_index: int, execute_reply: dict) -> None:
        self.reply = execute_reply.get("content", {})

    def run(self, cell: nbformat.NotebookNode, index: int) -> bool:
        """Run a cell; False if it timed out (nbclient interrupts the kernel then)."""
        self.client.execute_cell(cell, index)
        return self.reply.get("ename") != TIMED_OUT

    def run_code(self, code: str) -> nbformat.NotebookNode | None:
        """Run code of the grader's own; the cell with its outputs, or None if it timed out."""
        cell = self.client.nb.cells[self.own] = nbformat.v4.new_code_cell(code)
        return cell if self.run(cell, self.own) else None

    def probe(self, function: str | None) -> dict:
        """{"healthy": ..., "reference": ...} from probe.report (healthy None: no cluster is running)."""
        cell = self.run_code(f"import ddlab.tools.grading.probe\nddlab.tools.grading.probe.report({function!r})")
        for line in _text(cell).splitlines() if cell is not None else []:
            if line.startswith("{"):
                return json.loads(line)
        return {"healthy": False}

    def recover(self, replay: list[nbformat.NotebookNode]) -> str | None:
        """Restart the engines and replay the cells that set them up; None, or what went wrong."""
        cell = self.run_code(RESTART)
        if cell is None or any(output.output_type == "error" for output in cell.outputs):
            return "the engines could not be restarted: " + (_text(cell) if cell is not None else "it timed out")
        for done in replay:
            if self.run_code(done.source) is None:
                return "replaying the cells before it timed out after the engines were restarted"
        return None


def _is_px(cell: nbformat.NotebookNode) -> bool:
    return cell.source.lstrip().startswith(("%%px", "%px"))


def _outcome(
    check: Check, cell: nbformat.NotebookNode, finished: bool, state: dict[str, Any], timeout: float, note: str = ""
) -> tuple[str, str]:
    """(status, message) of a restored check cell: did it finish, and what did the probe after it say.

    `note`: why it may have failed (its exercise's cell not found, or that cell's error), added unless it passed."""
    if not finished:
        return "timed out", (
            f"the check did not finish within {timeout:.0f} s, so the engines were restarted: a loop that never ends, "
            "or a deadlock (such as a call on the notebook's comm or MPI.COMM_WORLD instead of the communicator the "
            "check passes, which the check's own deadline cannot interrupt)"
        )
    status, message = verdict(check, cell, state.get("reference"))
    if status != "passed":
        message += note
    if status != "passed" and state.get("healthy") is False:
        died = (
            f"The engines died or stopped answering during this check ({state.get('problem', 'MPI ended the job')}); "
            "they were restarted."
        )
        return "error", died if message.startswith(_SUMMARIES) else f"{message}\n{died}"
    return status, message


def _note(check: Check, lost: bool, raised: str | None) -> str:
    """What the result of a check that did not pass adds: its exercise's cell lost, or the error that cell raised."""
    if lost:
        return (
            f"\nNo cell of this notebook is {check.exercise}'s: none starts with '# {check.exercise}: "
            f"{check.function}' or defines {check.function}, so the check ran where the check before it did. "
            f"Copy the exercise's cell from the lab if it is gone, keep its first line, and name the function "
            f"{check.function}."
        )
    return f"\nThe exercise's cell raised an error before the check ran: {raised}" if raised else ""


def grade(
    lab: nbformat.NotebookNode, path: Path, student: str, timeout: float, seed: int | None = None
) -> list[Result]:
    """Run the submission at `path` against the lab's checks; one Result per check, in the lab's order.

    `seed`: the grader's draw (the checks' cases drawn from it); None runs the notebook's own cases."""
    outcomes: dict[str, tuple[str, str]] = {}  # grade id -> (status, message)
    try:
        submitted = nbformat.read(path, as_version=4)
    except Exception as err:  # not JSON, or not a notebook: nothing to run
        problem = f"{path.name} is not a notebook that can be read ({type(err).__name__}: {err}); nothing ran"
    else:
        # The grader's own failure too is this submission's alone: its checks not run are errors, the next is graded.
        try:
            with tempfile.TemporaryDirectory(prefix="ddlab-kernel-") as sockets:
                problem = _run(*prepare(lab, submitted), path, timeout, outcomes, seed, sockets)
        except Exception as err:
            problem = f"the grader failed on this notebook ({type(err).__name__}: {err}); grade it by hand or report it"
    results = []
    for check in checks(lab):
        status, message = outcomes.get(check.grade_id, ("error", problem))
        results.append(Result(student, check, status, check.points if status == "passed" else 0, message, seed))
    return results


def kernel_config(folder: str) -> Config:
    """The kernel's channels as Unix sockets in `folder`, not TCP ports: nothing listens on the network
    (and ipykernel has no plain-text TCP to warn about at every start)."""
    return Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(os.path.abspath(folder), "kernel")}})


def _run(
    notebook: nbformat.NotebookNode,
    placed: dict[int, Check],
    lost: set[str],
    path: Path,
    timeout: float,
    outcomes: dict[str, tuple[str, str]],
    seed: int | None,
    sockets: str,
) -> str:
    """Run the notebook up to its last check, filling in outcomes; return why the checks not reached were not.

    The kernel's sockets are made in the folder `sockets`."""
    client = NotebookClient(
        notebook,
        timeout=int(timeout),
        kernel_name=KERNEL,
        config=kernel_config(sockets),
        allow_errors=True,
        interrupt_on_timeout=True,
        error_on_timeout={"ename": TIMED_OUT, "evalue": "", "traceback": []},
        resources={"metadata": {"path": str(path.resolve().parent)}},
    )
    kernel, replay, raised = _Kernel(client), [], None
    env = {key: value for key, value in os.environ.items() if key != SEED_VARIABLE}
    if seed is not None:
        env[SEED_VARIABLE] = str(seed)
    try:
        with client.setup_kernel(env=env):
            for index in range(max(placed, default=-1) + 1):
                cell, check = notebook.cells[index], placed.get(index)
                if cell.cell_type != "code":
                    continue
                finished = kernel.run(cell, index)
                state: dict[str, Any] = (
                    kernel.probe(check.function if check else None) if finished else {"healthy": False}
                )
                if check is not None:
                    note = _note(check, check.grade_id in lost, raised)
                    outcomes[check.grade_id] = _outcome(check, cell, finished, state, timeout, note)
                else:  # a checked exercise's cell is the last one of these before its check
                    failed = any(output.output_type == "error" for output in cell.get("outputs", []))
                    raised = ": ".join(_raised(_text(cell))).splitlines()[0] if failed else None
                    if finished and state.get("healthy") and _is_px(cell):
                        replay.append(cell)
                if not finished or state.get("healthy") is False:
                    problem = kernel.recover(replay)
                    if problem is not None:
                        return problem
            kernel.run_code(STOP)
    except DeadKernelError:
        return "the kernel died before this check ran"
    return "this check never ran"


@contextlib.contextmanager
def private_ipython_dir() -> Iterator[str]:
    """A fresh IPython directory for this grading run (its kernels inherit it), removed after."""
    path, before = tempfile.mkdtemp(prefix="ddlab-grade-"), os.environ.get("IPYTHONDIR")
    os.environ["IPYTHONDIR"] = path
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop("IPYTHONDIR", None)
        else:
            os.environ["IPYTHONDIR"] = before
        shutil.rmtree(path, ignore_errors=True)


def leftovers(ipython_dir: str) -> list[psutil.Process]:
    """Controller, engine and mpiexec processes started under this IPython directory."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if any(word in cmdline for word in ("ipyparallel", "ipengine", "ipcontroller", "mpiexec", "prterun", "hydra")):
            with contextlib.suppress(psutil.Error):
                if proc.environ().get("IPYTHONDIR") == ipython_dir:
                    found.append(proc)
    return found


def clean_up(ipython_dir: str, wait: float = 20.0) -> list[str]:
    """Stop the clusters whose kernel is gone; kill what still runs after `wait` s; return what was killed."""
    for profile_dir in Path(ipython_dir).glob("profile_ddlab-*"):
        cleanup_orphans(profile_dir.name[len("profile_ddlab-") :])
    deadline = time.monotonic() + wait
    while (left := leftovers(ipython_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    killed = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            killed.append(f"pid {proc.pid}: {' '.join(proc.cmdline())[:120]}")
            proc.kill()
    return killed
