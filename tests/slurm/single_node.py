"""A private single-node Slurm for the test suite: install it (root, Debian/Ubuntu), start, stop.

Everything lives in one fresh folder (configuration, state, logs, the munge key and
socket), the daemons listen on free ports and use their own munge daemon, so this
Slurm disturbs neither a Slurm already on the machine nor another test run doing
the same at the same time. Commands reach it through $SLURM_CONF (see `env`).

    python tests/slurm/single_node.py install      # apt-get, idempotent, time-bounded
    python tests/slurm/single_node.py up           # prints the folder; export SLURM_CONF=<folder>/slurm.conf
    python tests/slurm/single_node.py down FOLDER  # cancels every job, stops the daemons
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

#: The daemons, the commands and munge. (Not Slurm's PMIx: ddlab starts Open MPI ranks with
#: Open MPI's own mpiexec and MPICH ranks with srun --mpi=pmi2, built into Slurm.)
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
COMMANDS = ["slurmctld", "slurmd", "munged", "sbatch", "srun", "squeue", "scancel", "scontrol"]

#: Engines on 2 cores: the node claims this many CPUs (SlurmdParameters=config_overrides).
NODE_CPUS = 8
#: And this much memory (MB), so that a job may ask for what a JupyterHub spawner asks (8G).
NODE_MEMORY_MB = 16384
#: The partition's time limit, so that tests can ask for more and see a job pend.
PARTITION_MAX_TIME = "4:00:00"
#: The node is this machine under its own name, as on a real cluster (Open MPI's mpiexec
#: inside a job recognises the node it runs on by name).
NODE = socket.gethostname().split(".")[0]
PARTITION = "course"
_MARK = "DDLAB_TEST_SLURM_DIR"  # in the daemons' environment: how stop() finds their processes


class CannotInstall(RuntimeError):
    """A package is not installed and cannot be installed here (not root, no apt-get, apt failed)."""


def _which(name: str) -> str | None:
    """A command's path, looking in the sbin folders too (not on every user's PATH)."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def missing() -> list[str]:
    """The Slurm and munge commands this machine lacks (empty when all are there)."""
    return [name for name in COMMANDS if _which(name) is None]


def install(timeout: float = 300.0) -> None:
    """Install Slurm and munge with apt-get unless present; raise CannotInstall saying why not.

    Daemons are not started by the packages (policy-rc.d), only by `SingleNode.start`.
    """
    apt_install(PACKAGES, missing, "Slurm", timeout)


def apt_install(packages: list[str], missing: Callable[[], list[str]], what: str, timeout: float = 300.0) -> None:
    """Install `packages` with apt-get unless `missing()` is empty; raise CannotInstall saying why not.

    One installation at a time on this machine (a lock), no service started by the packages.
    """
    if not missing():
        return
    if os.geteuid() != 0:
        raise CannotInstall(f"{what} is not installed ({', '.join(missing())} missing) and installing it needs root")
    if shutil.which("apt-get") is None:
        raise CannotInstall(
            f"{what} is not installed ({', '.join(missing())} missing) and this machine has no apt-get to install it"
        )
    deadline = time.monotonic() + timeout
    with _lock(Path(tempfile.gettempdir()) / "ddlab-apt-install.lock"), _no_service_starts():
        if not missing():  # another test run installed it while we waited
            return
        command = [
            "apt-get",
            "install",
            "-y",
            "-q",
            "--no-install-recommends",
            "-o",
            "DPkg::Lock::Timeout=120",
            *packages,
        ]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        done = _run_bounded(command, env, deadline)
        if done.returncode != 0:  # stale package lists: refresh once and retry
            _run_bounded(["apt-get", "update", "-q"], env, deadline)
            done = _run_bounded(command, env, deadline)
        if done.returncode != 0 or missing():
            raise CannotInstall(f"`{' '.join(command)}` failed:\n{done.stdout[-3000:]}")


def _run_bounded(command: list[str], env: dict[str, str], deadline: float) -> subprocess.CompletedProcess:
    left = deadline - time.monotonic()
    if left <= 0:
        raise CannotInstall(f"ran out of time installing before `{' '.join(command)}`")
    try:
        return subprocess.run(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=left
        )
    except subprocess.TimeoutExpired as err:
        raise CannotInstall(f"`{' '.join(command)}` took longer than allowed:\n{(err.output or '')[-3000:]}") from None


@contextlib.contextmanager
def _lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _no_service_starts():
    """Keep package scripts from starting services (munge, Slurm) while installing."""
    policy = Path("/usr/sbin/policy-rc.d")
    if policy.exists():
        yield
        return
    policy.write_text("#!/bin/sh\n# ddlab tests: installing Slurm, do not start services\nexit 101\n")
    policy.chmod(0o755)
    try:
        yield
    finally:
        policy.unlink()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class SingleNode:
    """One slurmctld, one slurmd and their munged, all under `folder`."""

    folder: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @classmethod
    def create(cls, parent: str | None = None) -> SingleNode:
        folder = Path(tempfile.mkdtemp(prefix="ddlab-slurm-", dir=parent))
        folder.chmod(0o755)  # slurmstepd and the job's user must reach the spool
        node = cls(folder)
        node._write_config()
        return node

    def _write_config(self) -> None:
        for sub in ("state", "spool", "tmp", "log"):
            (self.folder / sub).mkdir()
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        first_job = 1000 + (os.getpid() % 500) * 1000  # distinct job ids for concurrent runs
        self.conf.write_text(f"""\
# A single-node Slurm for ddlab's tests (written by tests/slurm/single_node.py).
ClusterName=ddlab
SlurmctldHost={NODE}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.folder}/munge.socket
StateSaveLocation={self.folder}/state
SlurmdSpoolDir={self.folder}/spool
TmpFS={self.folder}/tmp
SlurmctldPidFile={self.folder}/slurmctld.pid
SlurmdPidFile={self.folder}/slurmd.pid
SlurmctldLogFile={self.folder}/log/slurmctld.log
SlurmdLogFile={self.folder}/log/slurmd.log
FirstJobId={first_job}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=5
InactiveLimit=0
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} RealMemory={NODE_MEMORY_MB} State=UNKNOWN
PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime={PARTITION_MAX_TIME} State=UP
""")
        self.env = {"SLURM_CONF": str(self.conf)}

    def _daemon_env(self) -> dict[str, str]:
        return {**os.environ, **self.env, _MARK: str(self.folder)}

    def start(self, timeout: float = 60.0) -> None:
        """Start munged, slurmctld and slurmd; return once the node takes jobs."""
        env = self._daemon_env()
        f = self.folder
        self._daemon(
            [
                _which("munged"),
                "--force",
                f"--socket={f}/munge.socket",
                f"--key-file={f}/munge.key",
                f"--pid-file={f}/munged.pid",
                f"--log-file={f}/log/munged.log",
                f"--seed-file={f}/munged.seed",
            ],
            env,
        )
        self._daemon([_which("slurmctld"), "-i"], env)  # -i: ignore (absent) saved state
        self._daemon([_which("slurmd"), "-N", NODE], env)
        deadline = time.monotonic() + timeout
        while True:
            state = self.slurm("sinfo", "-h", "-n", NODE, "-o", "%T", check=False).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm node is {state or 'not known'} after {timeout:.0f} s.\n{self.logs()}")
            time.sleep(0.5)

    def _daemon(self, command: list[str], env: dict[str, str]) -> None:
        done = subprocess.run(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60, cwd=self.folder
        )
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stdout}\n{self.logs()}")

    def slurm(self, *command: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a Slurm command (sinfo, squeue, ...) against this Slurm."""
        return subprocess.run(
            list(command), env={**os.environ, **self.env}, capture_output=True, text=True, timeout=timeout, check=check
        )

    def jobs(self) -> list[str]:
        """Ids of the jobs this Slurm knows that have not ended."""
        out = self.slurm("squeue", "-h", "-o", "%i", check=False).stdout
        return out.split()

    def job_records(self) -> list[dict[str, str]]:
        """Every job slurmctld still remembers (finished ones for MinJobAge, 5 minutes)."""
        out = self.slurm("scontrol", "-o", "show", "job", check=False).stdout
        return [dict(word.split("=", 1) for word in line.split() if "=" in word) for line in out.splitlines()]

    def run_job(self, script: Path, timeout: float) -> dict[str, str]:
        """Submit a batch script and wait for its end; its record (JobState, ExitCode, ...)."""
        job = self.slurm("sbatch", "--parsable", str(script)).stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = next((r for r in self.job_records() if r.get("JobId") == job), {})
            if record.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return record
            time.sleep(0.5)
        self.slurm("scancel", job, check=False)
        raise TimeoutError(f"job {job} did not end within {timeout:.0f} s")

    def cancel_all(self, timeout: float = 60.0) -> None:
        """Cancel every job and wait until none is left."""
        deadline = time.monotonic() + timeout
        while (jobs := self.jobs()) and time.monotonic() < deadline:
            self.slurm("scancel", *jobs, check=False)
            time.sleep(0.5)

    def logs(self, lines: int = 20) -> str:
        """The last lines of every daemon log, for error messages."""
        text = []
        for log in sorted((self.folder / "log").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            text.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(text)

    def processes(self) -> list[psutil.Process]:
        """Daemons, step daemons and job processes of this Slurm still running."""
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                env = proc.environ()
                if env.get(_MARK) == str(self.folder) or env.get("SLURM_CONF") == str(self.conf):
                    if proc.pid != os.getpid():
                        found.append(proc)
        return found

    def job_processes(self) -> list[psutil.Process]:
        """Processes started by this Slurm's jobs (not its daemons) still running."""
        found = []
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                if "SLURM_JOB_ID" in proc.environ() and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        return found

    def stop(self, remove: bool = True) -> None:
        """Cancel all jobs, stop the daemons, kill whatever is left of them; remove the folder."""
        with contextlib.suppress(Exception):
            self.cancel_all(timeout=30)
        # Slurm's daemons first: they still talk to munged while shutting down.
        for pidfiles in (("slurmd.pid", "slurmctld.pid"), ("munged.pid",)):
            daemons = []
            for pidfile in pidfiles:
                with contextlib.suppress(OSError, ValueError, psutil.Error):
                    daemons.append(psutil.Process(int((self.folder / pidfile).read_text().split()[0])))
            for daemon in daemons:
                with contextlib.suppress(psutil.Error):
                    daemon.terminate()
            psutil.wait_procs(daemons, timeout=10)
        left = self.processes()
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=5)
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)


def main(argv: list[str]) -> int:
    usage = "usage: single_node.py install | up | down FOLDER"
    if not argv:
        print(usage, file=sys.stderr)
        return 2
    if argv[0] == "install":
        install()
        return 0
    if argv[0] == "up":
        install()
        node = SingleNode.create()
        node.start()
        print(node.folder)
        return 0
    if argv[0] == "down" and len(argv) == 2:
        node = SingleNode(Path(argv[1]))
        node.env = {"SLURM_CONF": str(node.conf)}
        node.stop()
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
