"""The environment ddlab gives MPI ranks (engines, benches, tests): nothing printed a student must ignore."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from ddlab.runtime import mpi

IN_CI = os.environ.get("CI", "").lower() == "true"


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


NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def _leave_session(base: Path, pid: int) -> Path:
    """What an mpiexec of this pid killed with SIGKILL leaves: its session directory and PMIx rendezvous file."""
    session = base / f"ompi.{pid}"
    session.mkdir(mode=0o700)
    (session / f"pmix.{socket.gethostname()}.tool.{pid}").write_text("")
    return session


def _free_pid() -> int:
    """A pid no process has, away from the ones being handed out now."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    while True:
        pid = random.randrange(1000, top - 1)
        if not any(psutil.pid_exists(p) for p in range(pid - 1, pid + 2)):
            return pid


def _start_as(pid: int, command: list[str], env: dict[str, str]) -> tuple[int, int, str]:
    """Run command with the given pid (the kernel hands out ns_last_pid + 1 next): (its pid, exit status, output)."""
    Path(NS_LAST_PID).write_text(str(pid - 1))
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.communicate(timeout=120)[0]
    return proc.pid, proc.returncode, out


def test_clear_stale_sessions_removes_only_what_no_running_mpiexec_owns(tmp_path):
    dead = _leave_session(tmp_path, _free_pid())
    alive = _leave_session(tmp_path, os.getpid())  # this process started before its directory: it owns it
    other = tmp_path / "ompi.notes"
    other.mkdir()
    assert mpi.clear_stale_sessions(str(tmp_path)) == [dead]
    assert not dead.exists() and alive.exists() and other.exists()


def test_a_session_left_by_a_killed_mpiexec_is_cleared_before_the_next_one_starts(tmp_path):
    """Open MPI refuses to start where a killed mpiexec of the same pid left its session (the flake of
    "The PMIx server's listener thread failed to start" once a run's pids wrapped); clearing it first lets it start."""
    if mpi.implementation() != "openmpi":
        pytest.skip("only Open MPI keeps a session directory named after mpiexec's pid")
    if not os.access(NS_LAST_PID, os.W_OK):
        if IN_CI:
            pytest.fail(f"CI=true, so this test must run, but {NS_LAST_PID} is not writable (it needs root)")
        pytest.skip(f"choosing mpiexec's pid needs root ({NS_LAST_PID})")
    env = {**mpi.launch_env(2), "TMPDIR": str(tmp_path)}
    command = [mpi.mpiexec_path(), "-n", "2", *mpi.launcher_args(2), sys.executable, "-c", "import mpi4py.MPI"]
    for _ in range(5):  # another process may take the pid first
        pid = _free_pid()
        stale = _leave_session(tmp_path, pid)
        got, status, out = _start_as(pid, command, env)
        if got == pid:
            break
        shutil.rmtree(stale)
    assert got == pid, "could not start mpiexec with a chosen pid"
    assert status != 0 and "listener thread failed to start" in out, out
    _leave_session(tmp_path, pid)
    assert mpi.clear_stale_sessions(str(tmp_path)) == [stale]
    for _ in range(5):
        got, status, out = _start_as(pid, command, env)
        if got == pid:
            break
    assert got == pid, "could not start mpiexec with a chosen pid"
    assert status == 0, out


def test_ranks_on_one_host_use_shared_memory_unless_the_user_chose_transports(monkeypatch):
    """Ranks on one machine skip libfabric's probe (about 1 s of every MPI_Init) and TCP's listener (a port on
    every interface): shared memory only. A user's own choice wins."""
    transports = {"openmpi": ("OMPI_MCA_btl", "self,sm"), "mpich": ("UCX_TLS", "^tcp")}
    name, ours = transports[mpi.implementation()]
    monkeypatch.delenv(name, raising=False)
    assert mpi.rank_env(4)[name] == ours
    monkeypatch.setenv(name, "self,tcp")
    assert mpi.rank_env(4)[name] == "self,tcp"


def test_ranks_on_several_hosts_keep_tcp_on_the_chosen_interface(monkeypatch):
    """network_env (the Slurm and JupyterHub profiles): every interface variable of this MPI names the one
    interface, none is set when no interface is chosen, and a user's own value wins."""
    names = mpi.INTERFACE_VARIABLES[mpi.implementation()]
    for name in names:
        monkeypatch.delenv(name, raising=False)
    assert {name: mpi.network_env("ib0")[name] for name in names} == dict.fromkeys(names, "ib0")
    assert not set(names) & set(mpi.network_env(""))
    monkeypatch.setenv(names[0], "eth1")
    assert mpi.network_env("ib0")[names[0]] == "eth1"
    assert mpi.network_env("") == {}  # the transports stay the site's: across hosts TCP or a fabric carries them


def test_a_launcher_that_outlives_its_ranks_is_stopped_once_they_have_ended(monkeypatch):
    """Under ULFM, after a rank's death, mpiexec may wait on when every rank has exited: `run_ranks` stops it
    LAUNCHER_GRACE seconds after `ended` says so, not at the job's deadline; without `ended`, the deadline holds."""
    stuck = [sys.executable, "-c", "import time; print('launched', flush=True); time.sleep(120)"]
    monkeypatch.setattr(mpi, "mpiexec_command", lambda n, fault_tolerant=False: stuck)
    monkeypatch.setattr(mpi, "LAUNCHER_GRACE", 0.5)
    start = time.monotonic()
    done = mpi.run_ranks(2, ["--"], timeout=60, ended=lambda: True)
    assert time.monotonic() - start < 10 and "launched" in done.stdout
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        mpi.run_ranks(2, ["--"], timeout=2, ended=lambda: False)
    with pytest.raises(subprocess.TimeoutExpired):
        mpi.run_ranks(2, ["--"], timeout=2)
    assert time.monotonic() - start < 20  # each at its deadline
