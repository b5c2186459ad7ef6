"""The environment ddlab gives MPI ranks (engines, benches, tests): nothing printed a student must ignore."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil


def test_a_one_sided_window_prints_nothing_on_stderr():
    """Lab 11's slow link opens an MPI.Win on every engine; no rank may print an MPI error doing so."""
    code = "from mpi4py import MPI; w = MPI.Win.Allocate(8, 8, comm=MPI.COMM_WORLD); w.Free(); print('freed')"
    done = subprocess.run(
        [sys.executable, "-m", "ddlab.runtime.mpi", "-n", "2", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("freed") == 2
    assert "Error" not in done.stderr, done.stderr


def test_a_launcher_stopped_with_sigterm_takes_its_ranks_down():
    """`timeout` or a batch system stops `python -m ddlab.runtime.mpi` with SIGTERM: no rank may be left running."""
    marker = f"ddlab-sigterm-test-{os.getpid()}"
    code = f"import sys, time; from mpi4py import MPI; print('up', flush=True); time.sleep(120)  # {marker}"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ddlab.runtime.mpi", "-n", "2", sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        for _ in range(2):
            assert launcher.stdout.readline().strip() == "up"
        launcher.terminate()
        assert launcher.wait(30) == 143
        deadline = time.monotonic() + 10
        while _running(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(marker), f"ranks left running: {_running(marker)}"
    finally:
        launcher.kill()
        for pid in _running(marker):
            os.kill(pid, signal.SIGKILL)


def _running(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line contains marker."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc.pid)
    return found
