"""Make sure a cluster's processes are gone: when it stops, and when the kernel that started it dies.

ipyparallel starts the controller and mpiexec in sessions of their own, so a notebook
kernel that dies without `ddlab.runtime.cluster.stop()` (killed by nbval's teardown, restarted
in JupyterLab, crashed) leaves them running. And once mpiexec is gone, by a SIGKILL of
its own or ipyparallel's after five seconds of SIGTERM, nothing reaps its engines: they
wait for the controller's heartbeat for about three minutes before they leave.

Every process ipyparallel starts for a cluster carries the cluster's profile folder and
id in its environment (IPP_PROFILE_DIR, IPP_CLUSTER_ID), and the nanny each engine
starts inherits them: that is how the processes of one cluster are found here,
whoever their parent is by then.

`ddlab.runtime.cluster.start()` starts `python -m ddlab.runtime.reaper OWNER_PID PROFILE_DIR CLUSTER_ID`
in a session of its own. It waits for the owner (the kernel) to exit, then kills the
cluster's processes on this machine, stops what runs elsewhere (a Slurm job) through the
cluster's record, and removes the record. `ddlab.runtime.cluster.stop()` ends it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ipyparallel as ipp  # imported while the owner lives, so the record goes as soon as it dies
import psutil

#: Seconds between two looks at the owner: a dead kernel's engines are gone within about this.
POLL = 0.2
#: Seconds the processes of a cluster get to disappear after SIGKILL.
KILL_TIMEOUT = 5.0


def processes(profile_dir: str, cluster_id: str) -> list[psutil.Process]:
    """This machine's processes of one cluster: controller, mpiexec, engines and their nannies."""
    me, folder = os.getpid(), os.path.realpath(profile_dir)
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
        if env.get("IPP_CLUSTER_ID") == cluster_id and os.path.realpath(env.get("IPP_PROFILE_DIR", "")) == folder:
            found.append(proc)
    return found


def kill(profile_dir: str, cluster_id: str, timeout: float = KILL_TIMEOUT) -> list[psutil.Process]:
    """SIGKILL every process of the cluster on this machine; return those still running after `timeout` s.

    A zombie (killed, but not yet waited for by its parent, or by an init that is slow to) counts as gone.
    """
    victims = processes(profile_dir, cluster_id)
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while (left := [proc for proc in victims if alive(proc)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def stop_recorded(cluster_file: Path) -> None:
    """Stop a cluster from its record (remote engines too: a batch launcher cancels its job) and remove it."""
    with contextlib.suppress(Exception):  # a record half-written by a killed kernel, or nothing left to stop
        ipp.Cluster.from_file(str(cluster_file), log_level=logging.ERROR).stop_cluster_sync()
    with contextlib.suppress(OSError):
        cluster_file.unlink()


def reap(profile_dir: str, cluster_id: str) -> list[psutil.Process]:
    """Everything of a cluster whose owner is gone: local processes killed, the rest stopped, the record removed.

    Returns the local processes that survived SIGKILL (none, unless the system is failing).
    """
    survivors = kill(profile_dir, cluster_id)
    stop_recorded(Path(profile_dir) / "security" / f"cluster-{cluster_id}.json")
    return survivors


def alive(proc: psutil.Process) -> bool:
    """True while the process runs (a zombie, dead but not yet waited for by its parent, does not)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch(owner: psutil.Process, profile_dir: str, cluster_id: str) -> list[psutil.Process]:
    """Wait for `owner` to exit, then reap its cluster."""
    while alive(owner):
        time.sleep(POLL)
    return reap(profile_dir, cluster_id)


def start_watching(profile_dir: str, cluster_id: str) -> subprocess.Popen:
    """Start a reaper for this process's cluster, outside this process's session so a kill of it spares the reaper."""
    log = Path(profile_dir) / "log" / f"reaper-{cluster_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", __name__, str(os.getpid()), profile_dir, cluster_id],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def main(argv: list[str] | None = None) -> int:
    """`python -m ddlab.runtime.reaper OWNER_PID PROFILE_DIR CLUSTER_ID` (started by ddlab.runtime.cluster.start)."""
    owner_pid, profile_dir, cluster_id = argv if argv is not None else sys.argv[1:]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop() ends the watch: nothing to reap
    try:
        owner = psutil.Process(int(owner_pid))
    except psutil.NoSuchProcess:  # the owner died before we looked
        survivors = reap(profile_dir, cluster_id)
    else:
        survivors = watch(owner, profile_dir, cluster_id)
    for proc in survivors:
        print(f"ddlab.runtime.reaper: pid {proc.pid} survived SIGKILL", file=sys.stderr)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
