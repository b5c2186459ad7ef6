"""ddlab.runtime.cluster outside a notebook: errors that say what to do, and orphan clean-up."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from ddlab.runtime import cluster, mpi


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(cluster.ClusterError, match="Known profiles: .*local"):
        cluster.start(n=2, profile="no-such-profile")


@pytest.mark.parametrize("n", [0, -1, 2.5, "4"])
def test_bad_engine_counts_are_refused(n):
    with pytest.raises(ValueError, match="positive number of engines"):
        cluster.start(n=n)


def test_engines_that_fail_show_their_output(tmp_path, monkeypatch):
    fake = tmp_path / "mpiexec"
    fake.write_text(
        textwrap.dedent("""\
        #!/bin/sh
        if [ "$1" = "--version" ]; then echo "HYDRA build details:"; exit 0; fi
        echo "fake-mpiexec: could not start any rank" >&2
        exit 3
    """)
    )
    fake.chmod(0o755)
    monkeypatch.setenv("DDLAB_MPIEXEC", str(fake))
    mpi.implementation.cache_clear()
    try:
        with pytest.raises(cluster.ClusterError, match="(?s)exited before registering.*could not start any rank"):
            cluster.start(n=2, timeout=60)
    finally:
        mpi.implementation.cache_clear()
    assert cluster.status().startswith("No cluster is running")


def test_a_killed_owner_leaves_an_orphan_that_the_next_start_removes(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(
        "import ddlab.runtime.cluster, time\nddlab.runtime.cluster.start(n=2)\nprint('up', flush=True)\ntime.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "up"
        engines = [p for p in psutil.Process(owner.pid).children(recursive=True)]
        assert engines, "the owner should have started controller and engine processes"
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    stopped = cluster.cleanup_orphans("local")
    assert f"ddlab-{owner.pid}" in stopped
    deadline = time.monotonic() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engines if _exists(p)):
        assert time.monotonic() < deadline, "orphaned engines are still running after clean-up"
        time.sleep(0.5)


def _exists(proc: psutil.Process) -> bool:
    try:
        return proc.is_running()
    except psutil.Error:
        return False


def test_running_context_manager_starts_and_stops():
    with cluster.running(n=2) as rc:
        rc[:].execute("from mpi4py import MPI; rank = MPI.COMM_WORLD.Get_rank()", block=True)
        assert rc[:].pull("rank", block=True) == [0, 1]
        assert cluster.status().startswith("2 engines up")
    assert cluster.status().startswith("No cluster is running")
