"""`ddlab doctor` on the local profile: a clean report on a working setup, and for each
failure it knows, provoked for real, the fix it names. (The Slurm failures are provoked in
tests/test_slurm.py against a real Slurm.)
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from ddlab.runtime import mpi
from ddlab.tools import cli, doctor

VENV_BIN = Path(sys.executable).parent
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
IS_ROOT = os.geteuid() == 0

# Another MPI's launcher as seen from mpi4py: it starts n copies that know nothing of each
# other (as MPICH's mpiexec does with an Open MPI mpi4py, and the other way round).
FOREIGN_MPIEXEC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "HYDRA build details:"; echo "    Version: 4.0.0"; exit 0; fi
n=$2; shift 2
while [ "${1#-}" != "$1" ]; do shift; done
pids=""
trap 'kill $pids 2>/dev/null; wait; exit 143' TERM INT
i=0; while [ $i -lt $n ]; do "$@" & pids="$pids $!"; i=$((i+1)); done
wait
"""


@pytest.fixture
def foreign_mpiexec(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "mpiexec"
    path.parent.mkdir()
    path.write_text(FOREIGN_MPIEXEC)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def as_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment of a finished setup: the course environment active, local profile."""
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("DDLAB_PROFILE", raising=False)
    monkeypatch.delenv("DDLAB_MPIEXEC", raising=False)
    if IS_ROOT and mpi.implementation() == "openmpi":  # a container's environment sets these
        for name, value in ROOT_ENV.items():
            monkeypatch.setenv(name, value)


@pytest.mark.timeout(400)
def test_a_working_setup_gets_a_clean_report(as_set_up: None) -> None:
    done = subprocess.run(
        [str(VENV_BIN / "ddlab"), "doctor", "-n", "2", "--timeout", "240"], capture_output=True, text=True, timeout=360
    )
    report = done.stdout
    assert done.returncode == 0, report + done.stderr
    assert report.rstrip().endswith("All checks passed."), report
    checks = [line for line in report.splitlines() if line.startswith("  ")]
    assert checks and all(line.split()[0] == "ok" for line in checks), report
    for words in ("mpiexec:", "MPI library:", "mpi4py:", "ipyparallel:", "engines: 2 engines", "allreduce:"):
        assert words in report, report


def test_another_mpis_mpiexec_first_on_path(
    as_set_up: None, foreign_mpiexec: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{foreign_mpiexec.parent}{os.pathsep}{os.environ['PATH']}")
    finding = doctor.check_path_mpiexec(2)
    assert finding.status == doctor.WARN, finding
    assert "2 singletons" in finding.detail and str(foreign_mpiexec) in finding.detail
    assert mpi.mpiexec_path() in finding.fix and "activate" in finding.fix


@pytest.mark.skipif(not IS_ROOT, reason="Open MPI refuses root only when run as root")
def test_open_mpi_as_root(as_set_up: None, monkeypatch: pytest.MonkeyPatch) -> None:
    if mpi.implementation() != "openmpi":
        pytest.skip("only Open MPI refuses to run as root")
    for name in ROOT_ENV:
        monkeypatch.delenv(name, raising=False)
    finding = doctor.check_mpiexec_by_hand(2)
    assert finding.status == doctor.WARN, finding
    assert "refuses to start as root" in finding.detail
    assert "OMPI_ALLOW_RUN_AS_ROOT=1" in finding.fix and "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in finding.fix


def test_more_ranks_than_slots(as_set_up: None) -> None:
    if mpi.implementation() != "openmpi":
        pytest.skip("MPICH oversubscribes without being asked")
    n = (os.cpu_count() or 1) + 1
    finding = doctor.check_mpiexec_by_hand(n)
    assert finding.status == doctor.WARN, finding
    assert f"one rank per core ({os.cpu_count()} here) and {n} were asked for" in finding.detail
    assert "--oversubscribe" in finding.fix and "python -m ddlab.runtime.mpi" in finding.fix


@pytest.mark.timeout(300)
def test_engines_that_never_register(as_set_up: None) -> None:
    # No engine can register within a tenth of a second: the same path as engines that
    # are too slow, or cannot reach the controller.
    [finding] = doctor.check_engines("local", 2, timeout=0.1)
    assert finding.status == doctor.FAIL, finding
    assert "registered within" in finding.detail
    assert "timeout=300" in finding.fix and "127.0.0.1" in finding.fix


@pytest.mark.timeout(300)
def test_engines_started_by_another_mpis_mpiexec_are_singletons(
    as_set_up: None, foreign_mpiexec: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDLAB_MPIEXEC", str(foreign_mpiexec))
    mpi.implementation.cache_clear()
    try:
        [finding] = doctor.check_engines("local", 2, timeout=180)
    finally:
        mpi.implementation.cache_clear()
    assert finding.status == doctor.FAIL, finding
    assert "singletons" in finding.detail
    assert "DDLAB_MPIEXEC" in finding.fix


@pytest.mark.parametrize(
    "message, words",
    [
        ("sbatch: error: invalid partition specified: gpu", "partition in"),
        ("sbatch: error: Invalid account or account/partition combination specified", "account in"),
        (
            "sbatch: error: Batch job submission failed: Requested node configuration is not available",
            "engines_per_node",
        ),
        ("srun: Job 12 step creation temporarily disabled, retrying (Requested nodes are busy)", "--overlap"),
        ("Sorry!  You were supposed to get help about:\n    no-pmix-but", 'launcher = "mpiexec"'),
        ("prterun was unable to launch the specified application as it could not\naccess an executable:", "set python"),
        ("slurmstepd: error: execve(): /opt/venv/bin/python: No such file or directory", "set python"),
    ],
)
def test_slurm_messages_map_to_the_setting_to_change(message: str, words: str) -> None:
    what, fix = doctor._slurm_problem(message, "settings.py")
    assert words in fix


def test_the_command_line_rejects_zero_engines() -> None:
    with pytest.raises(SystemExit):
        cli.main(["doctor", "-n", "0"])


def test_a_stale_session_is_named_with_the_way_out() -> None:
    """What Open MPI prints when a killed mpiexec of the same pid left its session (tests/test_mpi_env.py makes it happen)."""
    out = "The PMIx server's listener thread failed to start. We cannot\ncontinue.\n"
    what, fix = doctor._classify_mpiexec_output(out, 2, "mpiexec")
    assert "killed mpiexec" in what and "python -m ddlab.runtime.mpi --clear-stale" in fix


def test_the_network_check_names_where_ranks_listen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local: shared memory, nothing to warn about; a user's own TCP transport, or Slurm without an interface: a
    warning naming the way out; Slurm with network_interface: that interface."""
    transport, tcp = {"openmpi": ("OMPI_MCA_btl", "self,sm,tcp"), "mpich": ("UCX_TLS", "self,sm,tcp")}[
        mpi.implementation()
    ]
    for name in (transport, "DDLAB_SLURM_NETWORK_INTERFACE", *mpi.INTERFACE_VARIABLES[mpi.implementation()]):
        monkeypatch.delenv(name, raising=False)
    local = doctor.check_network("local", 4)
    assert local.status == doctor.OK and "shared memory only" in local.detail, local
    monkeypatch.setenv(transport, tcp)
    mine = doctor.check_network("local", 4)
    assert mine.status == doctor.WARN and "every interface" in mine.detail and transport in mine.fix, mine
    monkeypatch.delenv(transport)
    everywhere = doctor.check_network("slurm", 4)
    assert everywhere.status == doctor.WARN and "network_interface" in everywhere.fix, everywhere
    monkeypatch.setenv("DDLAB_SLURM_NETWORK_INTERFACE", "ib0")
    chosen = doctor.check_network("slurm", 4)
    assert chosen.status == doctor.OK and "on ib0 only" in chosen.detail, chosen
