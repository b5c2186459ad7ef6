"""`cluster.start(n=4, fault_tolerant=True)`: the lab's own engines under ULFM, on the local, Slurm and hub profiles.

One engine of a fault-tolerant 4-engine cluster is SIGKILLed while every engine runs collectives.
Then: that call ends within a deadline (engine 2 dead, the survivors' MPI calls erring, no hung
cell); the next call of the notebook's view fails at once naming the dead engine; the engine leaves
no process behind; the three survivors' MPI calls return errors, and they revoke, shrink and sum
over three; `restart()` brings back four engines whose COMM_WORLD holds four ranks again; `stop()`
leaves nothing. The same but the restart on the slurm profile (a batch job of the private
single-node Slurm of tests/conftest.py) and the jupyterhub one (engines as a new step of the
notebook's own job); tests/test_slurm.py restarts engines on Slurm (lab 00). The
launch commands are checked too, and on an MPI without ULFM, asking for a fault-tolerant cluster
is a clear error.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import ipyparallel as ipp
import psutil
import pytest
from ddlab.runtime import cluster, mpi, reaper
from ddlab.tools import slurm as slurm_tools

DEADLINE = 20.0  # seconds for what follows a kill: the view's error, the nanny's exit, the shrink
needs_ulfm = pytest.mark.skipif(
    mpi.implementation() != "openmpi", reason="ULFM needs Open MPI 5 (this is MPICH: ulfm_problem says so)"
)


def _survivors_shrink() -> tuple[str, int, int]:
    """Run on each survivor: see the failure on COMM_WORLD, revoke, shrink, sum the old ranks over the rest."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    try:
        world.allreduce(1)
        seen = "nothing"
    except MPI.Exception as err:  # ERR_PROC_FAILED, ERR_REVOKED; MPI_ERR_COMM after an earlier failed collective
        seen = err.Get_error_string()
    world.Revoke()
    survivors = world.Shrink()
    return seen, survivors.Get_size(), survivors.allreduce(world.Get_rank())


def _allreduce_for_a_minute() -> int:
    """Allreduce on COMM_WORLD again and again for up to a minute (an MPI error ends it sooner); how many."""
    import time

    from mpi4py import MPI

    count, end = 0, time.monotonic() + 60
    while time.monotonic() < end:
        MPI.COMM_WORLD.allreduce(1)
        count += 1
    return count


def _world_sum() -> tuple[int, int]:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.allreduce(MPI.COMM_WORLD.Get_rank())


def _lose_one_and_come_back(
    profile: str, timeout: float, where: Callable[[], None] = lambda: None, restart: bool = True
) -> None:
    """The scenario of this file's docstring on one profile; `where()` checks where the engines run.

    restart=False leaves out the restart (on Slurm's profiles tests/test_slurm.py restarts lab 00's engines)."""
    rc = cluster.start(n=4, profile=profile, timeout=timeout, fault_tolerant=True)
    try:
        where()
        running = cluster.current()
        assert running is not None and running.fault_tolerant
        assert "fault-tolerant (ULFM)" in cluster.status()
        view = running.view
        pids = view.apply_sync(os.getpid)
        family = [psutil.Process(pids[2]), *psutil.Process(pids[2]).children(recursive=True)]  # engine, nanny
        running_cell = view.apply_async(_allreduce_for_a_minute)  # a cell busy in collectives on every engine
        os.kill(pids[2], signal.SIGKILL)

        # The running cell does not hang: it ends within the deadline, engine 2 dead, the others' MPI erring.
        start = time.monotonic()
        with pytest.raises(ipp.error.CompositeError, match="(?s)Engine 2 died.*ERR_PROC_FAILED|ERR_REVOKED"):
            running_cell.get(timeout=DEADLINE)
        while 2 in rc.ids and time.monotonic() < start + DEADLINE:
            time.sleep(0.1)  # the nanny tells the controller
        assert sorted(rc.ids) == [0, 1, 3], f"engine 2 still registered {DEADLINE} s after its death"
        assert not running.healthy(), "a crash is missed (the grader restarts the engines)"
        with pytest.raises(cluster.ClusterError, match=r"Engine 2 \(MPI rank 2\) died.*rc\[\[0, 1, 3\]\].*restart"):
            view.apply_sync(os.getpid)
        assert "Engine 2 died; the survivors [0, 1, 3] still run" in cluster.status()
        view.execute("alive = True", targets=[0, 1, 3])  # %px --targets 0,1,3: the survivors alone still run
        assert rc[[0, 1, 3]].pull("alive") == [True] * 3

        # No orphan: the dead engine's nanny goes too; the survivors' processes are the ones from before.
        gone, alive = psutil.wait_procs(family, timeout=DEADLINE)
        assert not alive, f"processes of the killed engine left behind: {[p.cmdline() for p in alive]}"

        # The survivors' MPI returns errors; they shrink and sum over three (0 + 1 + 3).
        outcomes = rc[[0, 1, 3]].apply_async(_survivors_shrink).get(timeout=60)
        assert [o[1:] for o in outcomes] == [(3, 4)] * 3, outcomes
        assert any(o[0] != "nothing" for o in outcomes), f"no survivor's allreduce failed: {outcomes}"

        if restart:
            rc = cluster.restart(timeout=timeout)
            where()
            assert sorted(rc.ids) == [0, 1, 2, 3]
            assert cluster.current().view.apply_async(_world_sum).get(timeout=60) == [(4, 6)] * 4
            with pytest.raises(ValueError, match=r"No engine 7 is up: the engines up are \[0, 1, 2, 3\]"):
                cluster.kill_engine(7)
            cluster.kill_engine(3)  # asked for, as lab 19 does: not missed, so a grader goes on with the rest
            assert cluster.current().killed == {3} and cluster.current().healthy()
    finally:
        running = cluster.current()
        cluster.stop()
    if running is not None:
        left = reaper.processes(running.cluster.profile_dir, running.cluster.cluster_id)
        assert not left, f"processes left after stop(): {left}"


@needs_ulfm
@pytest.mark.timeout(300)
def test_a_killed_engine_is_named_survived_and_replaced_on_the_local_profile() -> None:
    _lose_one_and_come_back("local", timeout=120)


@needs_ulfm
@pytest.mark.timeout(600)
def test_a_killed_engine_is_named_survived_and_replaced_on_slurm(slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{Path(mpi.mpiexec_path()).parent}{os.pathsep}{os.environ['PATH']}")
    for name, value in mpi.root_env().items():
        monkeypatch.setenv(name, value)

    def in_a_slurm_job() -> None:
        jobs = [job for job in slurm.job_records() if job.get("JobName") == "ddlab-engines"]
        assert [job["JobState"] for job in jobs].count("RUNNING") == 1, jobs

    _lose_one_and_come_back("slurm", timeout=300, where=in_a_slurm_job, restart=False)
    deadline = time.monotonic() + 60
    while (left := slurm.jobs() or slurm.job_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)  # a cancelled job completes within KillWait
    assert not left, f"Slurm jobs or their processes left after stop(): {left}"


@needs_ulfm
@pytest.mark.timeout(600)
def test_a_killed_engine_is_named_survived_and_replaced_on_the_jupyterhub_profile(slurm, tmp_path: Path) -> None:
    # The notebook as batchspawner runs it: one task of a Slurm job; its engines are a new step of that job.
    output = tmp_path / "job.out"
    script = tmp_path / "spawner.sh"
    # this file's helpers in the job's __main__, so the engines get them by value
    notebook = f"exec(compile(open({__file__!r}).read(), {__file__!r}, 'exec')); "
    notebook += "_lose_one_and_come_back('jupyterhub', 300, restart=False); print('survived')"
    script.write_text(
        "#!/bin/sh\n#SBATCH --ntasks=1\n#SBATCH --cpus-per-task=5\n"
        f"#SBATCH --output={output}\nexport DDLAB_SLURM_LAUNCHER=mpiexec\n"
        f"srun {shlex.quote(sys.executable)} -c {shlex.quote(notebook)}\n"
    )
    job = slurm.run_job(script, timeout=540)
    report = output.read_text() if output.exists() else "(no output)"
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), f"{job}\n{report}"
    assert "survived" in report, report


def test_kill_engine_needs_a_cluster() -> None:
    cluster.stop()  # whatever an earlier test left
    with pytest.raises(cluster.ClusterError, match="No cluster is running"):
        cluster.kill_engine(2)


def test_without_ulfm_the_request_is_refused_saying_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = "this MPI was built without ULFM: use Open MPI 5 from `make setup`"
    monkeypatch.setattr(mpi, "ulfm_problem", lambda *_: problem)
    with pytest.raises(cluster.ClusterError, match="A fault-tolerant cluster cannot start: this MPI was built"):
        cluster.start(n=2, fault_tolerant=True)
    assert cluster.current() is None
    with pytest.raises(mpi.MPISetupError, match="without ULFM"):
        slurm_tools.launch_command(slurm_tools.Settings(launcher="mpiexec"), 4, ["engine"], fault_tolerant=True)


@needs_ulfm
def test_the_slurm_and_hub_launchers_pass_ulfm_to_mpiexec(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    settings = slurm_tools.Settings(launcher="mpiexec")
    command, _ = slurm_tools.launch_command(settings, 4, ["engine"], fault_tolerant=True)
    assert command[:3] == [mpi.mpiexec_path(), "-n", "4"] and "--with-ft ulfm engine" in " ".join(command)
    assert "--with-ft" not in slurm_tools.launch_command(settings, 4, ["engine"])[0]
    with pytest.raises(slurm_tools.SettingsError, match='set launcher = "mpiexec"'):
        slurm_tools.launch_command(slurm_tools.Settings(launcher="srun"), 4, ["engine"], fault_tolerant=True)
    # the jupyterhub profile: a new step of the notebook's job, mpiexec with ULFM
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("DDLAB_SLURM_LAUNCHER", "mpiexec")
    config = cluster.make_cluster(4, "jupyterhub", fault_tolerant=True).config
    hub = slurm_tools.AllocationEngines(profile_dir=str(tmp_path), cluster_id="c1", config=config, n=4)
    assert "--with-ft ulfm" in " ".join(hub.find_args())
    plain = slurm_tools.AllocationEngines(profile_dir=str(tmp_path), cluster_id="c1", n=4)
    assert "--with-ft" not in plain.find_args()
    # the slurm profile's batch job
    config = cluster.make_cluster(4, "slurm", fault_tolerant=True).config
    job = slurm_tools.SlurmEngines(profile_dir=str(tmp_path), cluster_id="c1", config=config)
    assert "--with-ft ulfm" in job.batch_script(4).splitlines()[-1]


@needs_ulfm
def test_the_doctor_says_when_a_slurm_profile_cannot_launch_ulfm(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddlab.tools import doctor

    monkeypatch.setenv("DDLAB_SLURM_LAUNCHER", "srun")
    finding = doctor.check_fault_tolerance("slurm")
    assert finding.status == doctor.WARN and 'set launcher = "mpiexec"' in finding.fix, finding
    monkeypatch.setenv("DDLAB_SLURM_LAUNCHER", "mpiexec")
    assert doctor.check_fault_tolerance("jupyterhub").status == doctor.OK
    assert "fault_tolerant=True" in doctor.check_fault_tolerance("local").detail
