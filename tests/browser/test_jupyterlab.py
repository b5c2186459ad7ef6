"""The course as a student meets it: JupyterLab, started as `make lab` starts it, in Chromium.

For lab 00 (the student's version, whose checks must fail on the stubs) and the solution
of lab 02 (the fast labs: the notebooks themselves run under nbval): open the notebook, pick the "Python (ddlab)" kernel, Run All, and read
from the page what a student sees (notebook_page.student_view_problems). In lab 00 then
take its way out of a hang: a cell stuck in a receive, the toolbar's stop button,
`ddlab.runtime.cluster.restart()`, and a next cell that works with the notebook's variables intact.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from browser_support import (
    ROOT,
    copy_notebooks,
    free_port,
    listening,
    stop_process_tree,
    wait_for_http,
    write_lab_settings,
)
from notebook_page import ENGINES_DOWN, NotebookPage, student_view_problems

#: (notebook, seconds allowed for Run All); the fast labs, as the course's own tests run them.
NOTEBOOKS = [("labs/00_cluster.ipynb", 240), ("solutions/02_collectives.ipynb", 300)]


@pytest.fixture(scope="module")
def jupyterlab(browser, tmp_path_factory: pytest.TempPathFactory):
    """`jupyter lab` as `make lab` runs it (loopback, a token), on copies of the notebooks.

    Copies, so that nothing the browser does reaches the repository. The kernels see what a
    student's do: no MPLBACKEND=Agg or DDLAB_PROGRESS=0 from the test suite.
    """
    folder = tmp_path_factory.mktemp("jupyterlab")
    root = folder / "course"
    copy_notebooks([path for path, _ in NOTEBOOKS], root)
    write_lab_settings(folder / "settings")
    port, token = free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "DDLAB_PROGRESS")}
    env.update(JUPYTER_CONFIG_DIR=str(folder / "config"), JUPYTER_RUNTIME_DIR=str(folder / "runtime"))
    jupyter = Path(sys.executable).parent / "jupyter"
    command = [
        str(jupyter),
        "lab",
        f"--notebook-dir={root}",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--LabApp.user_settings_dir={folder / 'settings'}",
        f"--LabApp.workspaces_dir={folder / 'workspaces'}",
    ]
    command += ["--allow-root"] if os.geteuid() == 0 else []
    log = folder / "jupyterlab.log"
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/api/status", server, log, timeout=120)
        yield f"http://127.0.0.1:{port}", token
    finally:
        left = stop_process_tree(server)
    assert not left, f"processes outlived JupyterLab: {left}"
    assert not listening(port), f"port {port} still listens after JupyterLab stopped"


def open_notebook(page, jupyterlab, path: str) -> NotebookPage:
    url, token = jupyterlab
    page.goto(f"{url}/lab?token={token}")  # the URL `make lab` prints: logs in, sets the cookie
    notebook = page.notebook = NotebookPage(page, f"{url}/lab")
    notebook.open(path)
    notebook.pick_kernel()
    return notebook


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path,seconds", NOTEBOOKS, ids=[Path(p).stem for p, _ in NOTEBOOKS])
def test_run_all_shows_what_a_student_expects(page, jupyterlab, path: str, seconds: int) -> None:
    notebook = open_notebook(page, jupyterlab, path)
    notebook.run_all(timeout=seconds)
    in_lab = path.startswith("labs/")
    notices = (ENGINES_DOWN,) if Path(path).stem == "00_cluster" else ()  # lab 00 crashes an engine on purpose
    problems = student_view_problems(notebook.cells(ROOT / path), ROOT / path, in_lab, notices)
    assert not problems, f"{path} in the browser:\n" + "\n".join(problems)
    if Path(path).stem == "00_cluster":
        recover_from_a_hang(notebook)
    notebook.shut_down_kernel()


def recover_from_a_hang(notebook: NotebookPage) -> None:
    """Lab 00's way out of a hang, clicked: stop button, restart(), and the notebook carries on."""

    def run(code: str, wait: bool = True) -> None:  # type into the empty last cell, Shift+Enter
        notebook.page.locator(".jp-Notebook .jp-Cell").last.locator(".cm-content").click()
        notebook.page.keyboard.insert_text(code)
        notebook.run_cell()  # Shift+Enter on the last cell adds an empty one below
        if wait:
            notebook.wait_until_idle(timeout=180)

    notebook.add_cell("")
    run('rc = ddlab.runtime.cluster.start(n=4)\nkept = "variables kept"')
    run(
        "%%px\nfrom mpi4py import MPI\nimport numpy as np\nMPI.COMM_WORLD.Recv(np.empty(1), source=MPI.ANY_SOURCE)",
        wait=False,
    )
    hung = notebook.page.locator(".jp-Notebook .jp-Cell").nth(-2)
    notebook.page.wait_for_timeout(3000)
    assert hung.locator(".jp-InputArea-prompt").inner_text().strip() == "[*]:", "the receive did not block"
    notebook.interrupt()
    notebook.wait_until_idle(timeout=60)
    hung_text = hung.inner_text()
    assert "Received Keyboard Interrupt" in hung_text, f"the interrupted cell shows:\n{hung_text}"
    run("rc = ddlab.runtime.cluster.restart()\nprint(ddlab.runtime.cluster.status())")
    run("print(kept, ranks)\nrc[:].apply_sync(lambda: __import__('mpi4py.MPI').MPI.COMM_WORLD.Get_rank())")
    run("ddlab.runtime.cluster.stop()")
    cells = notebook.cells()
    restarted, after, stopped = cells[-4], cells[-3], cells[-2]
    assert "4 engines up (MPI ranks 0..3)" in restarted.text(), str(restarted)
    assert not restarted.stderr and not after.stderr and not stopped.stderr, "\n".join(map(str, cells[-4:-1]))
    assert re.search(r"variables kept \[0, 1, 2, 3\]", after.text()), str(after)
    assert "[0, 1, 2, 3]" in after.text().splitlines()[-1], str(after)
