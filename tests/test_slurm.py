"""The slurm and jupyterhub profiles against a real Slurm: a private single-node Slurm
(the distribution's slurmctld, slurmd and munge; tests/slurm/single_node.py), installed
and started as root by the `slurm` fixture (tests/conftest.py) and stopped after the session.

Where Slurm cannot be installed (not root, no apt-get) these tests skip and say so. In CI
(CI=true) they must run: there, a failed installation fails them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from ddlab.runtime import mpi
from ddlab.tools import doctor
from ddlab.tools import slurm as slurm_tools

HERE = Path(__file__).parent
ROOT = HERE.parent
#: Lab 02 (collectives on 4 engines), and lab 00, whose hang and crash recovery restarts them.
LABS = [ROOT / "solutions" / "02_collectives.ipynb", ROOT / "solutions" / "00_cluster.ipynb"]


@pytest.fixture(autouse=True)
def nothing_left(request: pytest.FixtureRequest):
    """After each test no job, and no process a job started, may be left (they are killed)."""
    yield
    if "slurm" not in request.fixturenames:
        return
    node = request.getfixturevalue("slurm")
    deadline = time.monotonic() + 60
    while (jobs := node.jobs()) and time.monotonic() < deadline:
        time.sleep(0.5)  # cancelled jobs complete within KillWait
    while (left := node.job_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    node.cancel_all()
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert not jobs, f"jobs {jobs} were still queued or running after the test"
    assert not left, f"processes outlived their jobs: {[' '.join(p.cmdline())[:100] for p in left]}"


@pytest.fixture
def as_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished setup: the course environment active (root may run Open MPI, as in a container)."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("DDLAB_PROFILE", raising=False)
    for name, value in mpi.root_env().items():
        monkeypatch.setenv(name, value)


def _engine_jobs(node) -> list[dict[str, str]]:
    return [job for job in node.job_records() if job.get("JobName") == "ddlab-engines"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("lab", LABS, ids=lambda path: path.stem)
def test_solution_runs_on_engines_started_by_slurm(slurm, lab: Path) -> None:
    assert lab.exists(), f"{lab} is missing"
    before = {job["JobId"] for job in _engine_jobs(slurm)}
    env = {**os.environ, "DDLAB_PROFILE": "slurm"}
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(lab.relative_to(ROOT)),
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:warnings",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, f"{lab.name} failed on Slurm engines:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    jobs = [job for job in _engine_jobs(slurm) if job["JobId"] not in before]
    assert jobs and {job["NumTasks"] for job in jobs} == {"4"}, jobs  # the notebook's 4 engines, as Slurm jobs


def _interface_of(address: str) -> str:
    """The name of this machine's interface that holds address."""
    return next(name for name, found in psutil.net_if_addrs().items() if address in {a.address for a in found})


@pytest.mark.timeout(600)
def test_doctor_reports_clean_on_slurm(slurm, as_set_up: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With network_interface naming the controller's interface: clean, and the engines' MPI still works there."""
    interface = _interface_of(slurm_tools.controller_address(slurm_tools.load_settings()))
    monkeypatch.setenv("DDLAB_SLURM_NETWORK_INTERFACE", interface)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "ddlab"), "doctor", "--profile", "slurm", "-n", "2", "--timeout", "300"],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("All checks passed."), done.stdout
    assert "ok    engines: 2 engines on profile 'slurm'" in done.stdout
    assert f"ok    MPI network: ranks listen for MPI's TCP traffic on {interface} only" in done.stdout


@pytest.mark.timeout(600)
def test_doctor_explains_singletons_under_srun(slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    # srun --mpi=pmi2: Open MPI 5 speaks PMIx only, so each engine starts alone. (MPICH
    # does speak PMI2; it starts alone without any PMI.)
    monkeypatch.setenv("DDLAB_SLURM_LAUNCHER", "srun")
    monkeypatch.setenv("DDLAB_SLURM_MPI", "pmi2" if mpi.implementation() == "openmpi" else "none")
    [finding] = doctor.check_engines("slurm", 2, timeout=300)
    assert finding.status == doctor.FAIL, finding
    assert "singletons" in finding.detail
    assert 'launcher = "auto"' in finding.fix and "srun --mpi=list" in finding.fix


@pytest.mark.timeout(300)
def test_doctor_explains_a_job_that_never_starts(slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDLAB_SLURM_TIME", "8:00:00")  # the partition allows 4 hours
    [finding] = doctor.check_engines("slurm", 2, timeout=15)
    assert finding.status == doctor.FAIL, finding
    assert "still queued (reason: PartitionTimeLimit)" in finding.detail
    assert "lower time in" in finding.fix


@pytest.mark.timeout(300)
def test_doctor_explains_a_refused_job(slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDLAB_SLURM_PARTITION", "gpu-h100")
    [finding] = doctor.check_engines("slurm", 2, timeout=60)
    assert finding.status == doctor.FAIL, finding
    assert "invalid partition specified: gpu-h100" in finding.detail
    assert "set partition in" in finding.fix


@pytest.mark.timeout(300)
def test_doctor_explains_engines_missing_on_compute_nodes(slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDLAB_SLURM_PYTHON", "/nonexistent/venv/bin/python")
    [finding] = doctor.check_engines("slurm", 2, timeout=120)
    assert finding.status == doctor.FAIL, finding
    assert "FAILED" in finding.detail  # the job's state
    assert "set python in" in finding.fix


@pytest.mark.timeout(600)
def test_jupyterhub_profile_starts_engines_inside_the_notebooks_job(slurm, tmp_path: Path) -> None:
    # What batchspawner does: one task with a few CPUs, the notebook server as its step.
    output = tmp_path / "job.out"
    script = tmp_path / "spawner.sh"
    script.write_text(
        "#!/bin/sh\n"
        "#SBATCH --ntasks=1\n#SBATCH --cpus-per-task=5\n"
        f"#SBATCH --output={output}\n"
        f"srun {Path(sys.executable).parent / 'ddlab'} doctor --profile jupyterhub -n 4 --timeout 300\n"
    )
    job = slurm.run_job(script, timeout=540)
    report = output.read_text() if output.exists() else "(no output)"
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), f"{job}\n{report}"
    assert "ok    engines: 4 engines on profile 'jupyterhub'" in report, report
    assert "ok    allreduce: 8 MiB over 4 ranks" in report, report
