"""`ddlab doctor`: check that MPI, mpi4py, ipyparallel and a cluster profile work, and say what to change.

    $ ddlab doctor                      # local profile, 2 engines
    $ ddlab doctor --profile slurm -n 4
    >>> import ddlab.tools.doctor; ddlab.tools.doctor.run()     # from a notebook

Each check prints one line (ok, WARN or FAIL); a WARN or FAIL names the fix. The known
failures: another MPI's mpiexec first on PATH, Open MPI refusing root, more ranks than
slots, engines that never register (and, on Slurm, why: queued, failed, unreachable
controller), and engines started as 1-rank singletons instead of one MPI job.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..runtime import mpi

OK, WARN, FAIL = "ok", "WARN", "FAIL"
REPO_HINT = "run `make setup` in the course folder"

# What one rank reports about its MPI world; run with `python -c`.
_HELLO = (
    "import sys\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\nsys.stdout.write(f'DDLAB-HELLO {c.rank} {c.size}\\n')\n"
)

# mpi4py's version, the MPI library it loaded (without initialising MPI) and from where.
_LIBRARY = (
    "import json, os, mpi4py\n"
    "mpi4py.rc.initialize = False\n"
    "from mpi4py import MPI\n"
    "maps = '/proc/self/maps'\n"
    "libs = sorted({l.split()[-1] for l in open(maps) if 'libmpi.' in l}) if os.path.exists(maps) else []\n"
    "print(json.dumps({'version': mpi4py.__version__, 'library': MPI.Get_library_version().strip(chr(0)).strip(),"
    " 'libmpi': ', '.join(libs) or 'path unknown', 'module': MPI.__file__}))\n"
)


@dataclass
class Finding:
    """One check's outcome: what was found and, unless ok, what to change."""

    check: str
    status: str
    detail: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"  {self.status:<5} {self.check}: {self.detail}"
        if self.fix:
            text += "\n" + textwrap.indent(textwrap.fill(f"fix: {self.fix}", 96), " " * 8)
        return text


@dataclass(repr=False)
class Report:
    """Every finding of one doctor run, printed as the report."""

    profile: str
    n: int
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing failed (warnings concern MPI commands typed by hand)."""
        return all(f.status != FAIL for f in self.findings)

    def needing_attention(self) -> list[Finding]:
        return [f for f in self.findings if f.status != OK]

    def __repr__(self) -> str:  # what a notebook shows after the printed report
        bad = len(self.needing_attention())
        return f"<doctor report: {'all checks passed' if not bad else f'{bad} check(s) need attention'}>"

    def __str__(self) -> str:
        lines = [f"ddlab doctor: profile {self.profile!r}, {self.n} engines"]
        lines += [str(f) for f in self.findings]
        bad = self.needing_attention()
        lines.append("All checks passed." if not bad else f"{len(bad)} check(s) need attention (see fix: above).")
        return "\n".join(lines)


# --- the MPI installation ----------------------------------------------------------


def _run(command: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int | None, str]:
    """(exit code or None on timeout, output) of a short command; MPI jobs are killed on timeout."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        mpi.kill_session(proc)
        return None, proc.communicate()[0]


def check_python() -> Finding:
    """Which Python and ddlab run."""
    return Finding("Python", OK, f"{sys.version.split()[0]} at {sys.executable}, ddlab {__version__}")


def mpi4py_library() -> dict:
    """mpi4py's version, the compiled module it loaded, and the MPI library behind it (path, version)."""
    code, out = _run([sys.executable, "-c", _LIBRARY])
    if code != 0:
        raise RuntimeError(out.strip()[-2000:])
    return json.loads(out.strip().splitlines()[-1])


def library_name(version: str) -> str:
    """'Open MPI v5.0.11' or 'MPICH Version: 5.0.2' from an MPI library's long version text."""
    first = version.strip("\0 \n").splitlines()[0]
    return " ".join(first.split(",")[0].split())


def _implementation_of(text: str) -> str:
    """'openmpi', 'mpich' or 'unknown' from a library's version text."""
    text = text.lower()
    if "open mpi" in text:
        return "openmpi"
    if "mpich" in text:
        return "mpich"
    return "unknown"


def check_mpi_library() -> list[Finding]:
    """Which mpiexec ddlab uses, which MPI mpi4py runs on, and whether they match."""
    try:
        exe = mpi.mpiexec_path()
        impl = mpi.implementation(exe)
        _, version = _run([exe, "--version"], env=mpi.launch_env())
    except mpi.MPISetupError as err:
        return [
            Finding("mpiexec", FAIL, str(err), REPO_HINT + ", or set DDLAB_MPIEXEC to an mpiexec that matches mpi4py.")
        ]
    number = re.search(r"\d+\.\d+(\.\d+)?", version)
    names = {"openmpi": "Open MPI", "mpich": "MPICH"}
    found = [Finding("mpiexec", OK, f"{exe} ({names.get(impl, impl)}{' ' + number.group(0) if number else ''})")]
    try:
        lib = mpi4py_library()
    except (RuntimeError, ValueError, IndexError) as err:
        found.append(
            Finding(
                "mpi4py",
                FAIL,
                f"cannot load mpi4py's MPI library: {err}",
                f"{REPO_HINT} (it installs mpi4py together with the MPI wheel).",
            )
        )
        return found
    library = library_name(lib["library"])
    found.append(Finding("MPI library", OK, f"{library} ({lib['libmpi']})"))
    found.append(Finding("mpi4py", OK, f"{lib['version']}, running its {Path(lib['module']).name} build"))
    if _implementation_of(library) != impl:
        found[-1] = Finding(
            "mpi4py",
            FAIL,
            f"mpi4py runs on {library}, but ddlab's mpiexec ({exe}) belongs to {impl}: ranks would start as singletons",
            "unset DDLAB_MPIEXEC, or reinstall with `make setup` (MPI=openmpi or MPI=mpich) so both come from one MPI.",
        )
    return found


def check_fault_tolerance(profile: str = "local") -> Finding:
    """Whether the MPI can run fault-tolerant jobs (ULFM): lab 19's, and `cluster.start(n, fault_tolerant=True)`
    on the profile (on Slurm, only Open MPI's own mpiexec launches ULFM). A warning only: the other labs do
    not need it."""
    name = "fault tolerance (ULFM)"
    try:
        problem = mpi.ulfm_problem()
    except mpi.MPISetupError as err:
        return Finding(name, WARN, f"unknown: {err}", REPO_HINT + ".")
    if problem:
        return Finding(name, WARN, "not supported: lab 19's checks cannot run", problem)
    if profile in ("slurm", "jupyterhub"):
        from . import slurm

        with contextlib.suppress(slurm.SettingsError, SyntaxError, OSError):  # check_network names those
            if slurm.load_settings().resolved_launcher() != "mpiexec":
                return Finding(
                    name,
                    WARN,
                    f"supported by this MPI, but profile {profile!r} launches engines with srun",
                    f'for cluster.start(n, profile={profile!r}, fault_tolerant=True) set launcher = "mpiexec" '
                    f"in {slurm.settings_file()}: ULFM needs Open MPI's own mpiexec.",
                )
    return Finding(name, OK, "supported: lab 19's jobs and cluster.start(n, fault_tolerant=True) use --with-ft ulfm")


def check_ipyparallel() -> Finding:
    """ipyparallel new enough for ddlab's cluster API."""
    import ipyparallel

    version = ipyparallel.__version__
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) < (8, 8):
        return Finding("ipyparallel", FAIL, f"{version} is too old (ddlab needs 8.8 or newer)", REPO_HINT + ".")
    return Finding("ipyparallel", OK, version)


def hello_sizes(output: str) -> list[int]:
    """The world sizes reported by ranks running _HELLO."""
    return [int(size) for _, size in re.findall(r"DDLAB-HELLO (\d+) (\d+)", output)]


def _classify_mpiexec_output(out: str, n: int, exe: str) -> tuple[str, str] | None:
    """(what happened, what to change) for the failures Open MPI and MPICH print, or None."""
    low = out.lower()
    if "as root" in low or "allow-run-as-root" in low:
        return (
            "Open MPI refuses to start as root",
            "ddlab sets OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 for its own launches; for "
            "mpiexec typed by hand export both (e.g. in a container's environment), or work as a normal user.",
        )
    if "listener thread failed to start" in low:
        return (
            "Open MPI found the session a killed mpiexec with the same pid left in the temporary folder",
            "ddlab clears such sessions before its own launches; before typing mpiexec, run "
            "`python -m ddlab.runtime.mpi --clear-stale`.",
        )
    if "not enough slots" in low:
        cores = os.cpu_count() or 1
        return (
            f"Open MPI starts at most one rank per core ({cores} here) and {n} were asked for",
            f"add --oversubscribe (`{exe} --oversubscribe -n {n} ...`), or use `python -m ddlab.runtime.mpi -n {n} ...` "
            "which adds it when needed, or start fewer ranks.",
        )
    return None


def check_path_mpiexec(n: int = 2, timeout: float = 60) -> Finding:
    """The mpiexec a user gets by typing `mpiexec`: ddlab's, or another MPI's that starts singletons?"""
    name = "mpiexec on PATH"
    ours = mpi.mpiexec_path()
    theirs = shutil.which("mpiexec")
    if theirs is None:
        return Finding(name, OK, f"none; ddlab uses {ours} (activate the environment to type `mpiexec` yourself)")
    if Path(theirs).resolve() == Path(ours).resolve():
        return Finding(name, OK, f"{theirs}, the one ddlab uses")
    code, out = _run([theirs, "-n", str(n), sys.executable, "-c", _HELLO], env=mpi.launch_env(n), timeout=timeout)
    sizes = hello_sizes(out)
    if code == 0 and sizes == [n] * n:
        return Finding(name, OK, f"{theirs} differs from ddlab's {ours} but starts {n}-rank jobs with this mpi4py")
    what = (
        f"{n} singletons (every rank alone in its own 1-rank world)"
        if sizes and set(sizes) == {1}
        else f"no {n}-rank job (exit {code}): {out.strip()[-300:]}"
    )
    return Finding(
        name,
        WARN,
        f"{theirs} is another MPI's mpiexec than mpi4py's ({ours}); `mpiexec -n {n} python ...` starts {what}",
        f"use {ours} (or `source {Path(ours).parent}/activate` so it comes first on PATH), or "
        f"`python -m ddlab.runtime.mpi -n {n} ...`; remove or unload the other MPI (e.g. `module unload`) "
        "if you do not need it.",
    )


def check_mpiexec_by_hand(n: int = 2, timeout: float = 120) -> Finding:
    """ddlab's mpiexec run the way a user types it (no flags, the user's environment)."""
    name = "mpiexec by hand"
    exe = mpi.mpiexec_path()
    in_step = bool(os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_STEP_ID"))
    timeout = min(timeout, 30) if in_step else timeout
    mpi.clear_stale_sessions()  # as ddlab does before its own launches: what killed jobs left is no setup fault
    code, out = _run([exe, "-n", str(n), sys.executable, "-c", _HELLO], env=dict(os.environ), timeout=timeout)
    sizes = hello_sizes(out)
    if code == 0 and sizes == [n] * n:
        as_root = os.geteuid() == 0 and mpi.implementation() == "openmpi"
        extra = ", allowed as root by OMPI_ALLOW_RUN_AS_ROOT" if as_root else ""
        return Finding(name, OK, f"`{Path(exe).name} -n {n} python` starts one {n}-rank job{extra}")
    if in_step and (code is None or "not enough slots" in out.lower()):
        # A terminal of a notebook spawned into Slurm: mpiexec sees the notebook's step.
        oversubscribe = " --oversubscribe" if mpi.implementation() == "openmpi" else ""
        return Finding(
            name,
            WARN,
            f"inside this notebook's Slurm job step, `mpiexec -n {n}` "
            + (
                f"did not start within {timeout:.0f} s (its srun waits for the CPUs the notebook's step holds)"
                if code is None
                else "sees only the step's single slot"
            )
            + " (ddlab's engines are not affected)",
            f"type `SLURM_OVERLAP=1 {exe}{oversubscribe} -n {n} ...` (SLURM_OVERLAP=1 is srun --overlap).",
        )
    if code is None:
        return Finding(
            name,
            FAIL,
            f"`{exe} -n {n} python` did not finish in {timeout:.0f} s",
            "the machine may be overloaded, or a firewall blocks local TCP connections; "
            "try `python -m ddlab.runtime.mpi -n 2 --timeout 60 python -c 'import mpi4py.MPI'`.",
        )
    known = _classify_mpiexec_output(out, n, exe)
    if known:
        return Finding(
            name, WARN, f"`{exe} -n {n} python ...`: {known[0]} (ddlab's own launches are not affected)", known[1]
        )
    if sizes and set(sizes) == {1}:
        return Finding(
            name,
            FAIL,
            f"`{exe} -n {n}` started {n} singletons: mpi4py uses another MPI than {exe}",
            REPO_HINT + " so mpi4py and mpiexec come from the same MPI wheel.",
        )
    return Finding(name, FAIL, f"`{exe} -n {n} python` failed (exit {code}):\n{out.strip()[-1500:]}", REPO_HINT + ".")


def check_network(profile: str, n: int) -> Finding:
    """Which interfaces the profile's ranks will listen on for MPI's TCP traffic; a warning when it is every one."""
    from . import slurm

    name = "MPI network"
    launcher = {
        "openmpi": "mpiexec's out-of-band port: every interface (Open MPI's PRRTE binds it so, whatever the settings)",
        "mpich": "mpiexec's control port: every interface (MPICH's Hydra binds it so)",
    }[mpi.implementation()]
    if profile == "local" and Path(mpi.launcher_path()).name == "mpiexec.gforker":
        launcher = "mpiexec.gforker starts the ranks and listens on nothing"
    if profile == "local":
        env = {**os.environ, **mpi.rank_env(n)}
        fix = "unset the transport variable you exported (OMPI_MCA_btl or UCX_TLS): ranks on one host need no TCP."
    else:
        try:
            settings = slurm.load_settings()
        except (slurm.SettingsError, SyntaxError, OSError) as err:
            return Finding(name, FAIL, str(err), f"correct {slurm.settings_file()}.")
        env = {**os.environ, **mpi.network_env(settings.network_interface)}
        fix = (
            f"set network_interface in {slurm.settings_file()} (or $DDLAB_SLURM_NETWORK_INTERFACE) to the "
            "cluster-internal network's interface (e.g. ib0) or its subnet in CIDR notation (see docs/hpc.md)."
        )
        if settings.resolved_launcher() == "srun":
            launcher = "started by srun (Slurm's own daemons)"
    where = mpi.rank_interfaces(env)
    if where is None:
        return Finding(name, OK, f"ranks: shared memory only, no TCP listener; {launcher}")
    if where == "":
        return Finding(name, WARN, f"ranks listen for MPI's TCP traffic on every interface; {launcher}", fix)
    return Finding(name, OK, f"ranks listen for MPI's TCP traffic on {where} only; {launcher}")


# --- the engines --------------------------------------------------------------------


def _probe() -> dict:
    """Runs on each engine: its MPI rank, world size, host and library."""
    import socket

    from mpi4py import MPI

    from ddlab.tools.doctor import library_name  # shipped by value: import what it uses

    comm = MPI.COMM_WORLD
    return {
        "rank": comm.rank,
        "size": comm.size,
        "host": socket.gethostname(),
        "library": library_name(MPI.Get_library_version()),
    }


def _allreduce(nbytes: int, repetitions: int) -> tuple[bool, float]:
    """Runs on each engine: (sum correct, median seconds) of Allreduce on nbytes of float64."""
    import time

    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    x = np.full(max(1, nbytes // 8), comm.rank + 1.0)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    times = []
    for _ in range(repetitions):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(x, y)
        times.append(time.perf_counter() - start)
    want = comm.size * (comm.size + 1) / 2
    return bool(np.all(y == want)), float(np.median(times))


def _slurm_preflight(profile: str) -> Finding | None:
    """Slurm commands present, settings readable, controller address on this host."""
    from . import slurm

    missing = [c for c in ("sbatch", "srun", "squeue", "scancel", "scontrol") if shutil.which(c) is None]
    if missing:
        return Finding(
            "Slurm",
            FAIL,
            f"{', '.join(missing)} not found on PATH",
            "run the notebook on the cluster's login or JupyterHub node, or `module load slurm` first; "
            "on a laptop use profile 'local'.",
        )
    if profile == "jupyterhub" and not os.environ.get("SLURM_JOB_ID"):
        return Finding(
            "Slurm",
            FAIL,
            "profile 'jupyterhub' starts engines inside this notebook's Slurm job, but "
            "$SLURM_JOB_ID is not set (the notebook does not run in a job)",
            "use profile 'slurm' (engines submitted as a job), or spawn the notebook with batchspawner.",
        )
    try:
        settings = slurm.load_settings()
    except (slurm.SettingsError, SyntaxError, OSError) as err:
        return Finding("Slurm settings", FAIL, str(err), f"correct {slurm.settings_file()}.")
    address = slurm.controller_address(settings)
    mine = slurm.host_addresses()
    if address not in mine:
        return Finding(
            "controller address",
            FAIL,
            f"{address} is not an address of this machine (it has {', '.join(mine)}), "
            "so the controller cannot listen there",
            f"set controller_address in {slurm.settings_file()} (or $DDLAB_SLURM_CONTROLLER_ADDRESS) "
            "to the one "
            "compute nodes reach, usually the cluster-internal network's.",
        )
    return None


def _slurm_problem(text: str, settings_path: str) -> tuple[str, str] | None:
    """Known sbatch/srun/job messages -> (what happened, what to change)."""
    low = " ".join(text.lower().split())  # messages wrap lines; match across them
    table = [
        (
            "invalid partition",
            "Slurm does not know the partition",
            f'set partition in {settings_path} to one `sinfo -s` lists (or "" for the default).',
        ),
        (
            "invalid account",
            "Slurm refuses the account",
            f'set account in {settings_path} to one `sacctmgr show assoc user=$USER` lists (or "").',
        ),
        (
            "requested time limit",
            "the time limit is not allowed",
            f'lower time in {settings_path} to at most the partition\'s limit (`sinfo -o "%P %l"`).',
        ),
        (
            "requested node configuration is not available",
            "no node has that many CPUs",
            f'lower engines_per_node or cpus_per_engine in {settings_path} (CPUs per node: `sinfo -o "%P %c"`).',
        ),
        (
            "requested nodes are busy",
            "a nested srun waits for CPUs the notebook's own job step holds",
            "start engines inside an allocation with `srun --overlap` (the jupyterhub profile does).",
        ),
        (
            "no-pmix-but",
            "srun offered PMI2 but this Open MPI only speaks PMIx, so every engine started alone",
            f'set launcher = "mpiexec" (or "auto") in {settings_path}.',
        ),
        (
            "pmi2_init failed",
            "the ranks could not reach srun's PMI2 server",
            f'set launcher = "auto" in {settings_path}.',
        ),
        (
            "an error occurred in mpi_init",
            "MPI could not start under srun (with Open MPI: Slurm's PMIx is older "
            "than the wheel's; Debian 12's Slurm 22.05 has PMIx 4, Open MPI 5 needs a matching PMIx)",
            f'set launcher = "mpiexec" (or "auto") in {settings_path}: '
            "Open MPI's own mpiexec starts the ranks inside the job.",
        ),
        (
            "no module named",
            "the engines' Python cannot import a module it needs",
            "the course environment must be visible on compute nodes (a shared file system), "
            f"or set python in {settings_path}.",
        ),
        (
            "access an executable",
            "the engines' Python does not exist on the compute node",
            f"put the course environment on a file system compute nodes see, or set python in {settings_path}.",
        ),
        (
            "no such file or directory",
            "a program of the engines' command does not exist on the compute node",
            f"put the course environment on a file system compute nodes see, or set python in {settings_path}.",
        ),
    ]
    for needle, what, fix in table:
        if needle in low:
            return what, fix
    return None


_PENDING_FIXES = {
    "PartitionTimeLimit": 'lower time in {path} to at most the partition\'s limit (`sinfo -o "%P %l"`).',
    "Resources": "the cluster is busy: wait (ddlab doctor --timeout 600 / start(n, timeout=600)), ask for fewer "
    'engines, or ask the admins for a reservation and add "--reservation=NAME" to sbatch_options '
    "in {path}.",
    "Priority": "other jobs come first: wait (a longer timeout), or use a reservation (sbatch_options in {path}).",
    "ReqNodeNotAvail": "the nodes are down or reserved: pick another partition in {path}.",
    "PartitionDown": "the partition is down: pick another partition in {path}.",
    "PartitionInactive": "the partition is inactive: pick another partition in {path}.",
    "InvalidAccount": "set account in {path} to one you may use (`sacctmgr show assoc user=$USER`).",
    "InvalidQOS": "fix the --qos in sbatch_options in {path}.",
    "QOSMaxWallDurationPerJobLimit": "lower time in {path} to the QOS's limit.",
}


def _diagnose_slurm_start(error: BaseException, cluster: object) -> tuple[str, str]:
    """From the error, the job's state and the engines' output: what went wrong, what to change."""
    from . import slurm

    path = str(slurm.settings_file())
    text = str(error)
    sets = list(getattr(cluster, "engines", {}).values()) if cluster is not None else []
    engine_set = sets[0] if sets else None
    jobs = engine_set if isinstance(engine_set, slurm.SlurmEngines) else None
    state, reason = jobs.job_status() if jobs is not None else ("", "")
    job_id = jobs.job_id if jobs is not None else "?"
    if engine_set is not None and "Their last output" not in text:  # not from cluster: add the engines' words
        with contextlib.suppress(Exception):
            text += "\n" + engine_set.get_output()
    if isinstance(error, slurm.SubmitError):  # sbatch refused the job
        known = _slurm_problem(str(error), path)
        what = str(error).splitlines()[0]
        return (what + (f" ({known[0]})" if known else ""), known[1] if known else f"check the settings in {path}.")
    if state == "PENDING":
        fix = _PENDING_FIXES.get(
            reason, "see the reason under JOB REASON CODES in `man squeue`; change the settings in {path}."
        )
        return (
            f"the engines' job {job_id} is still queued (reason: {reason}), so no engine started",
            fix.format(path=path),
        )
    if state == "TIMEOUT":
        return (f"the engines' job {job_id} reached its time limit", f"raise time in {path}.")
    known = _slurm_problem(text, path)
    if known:
        return f"{known[0]}.\n{_tail(text)}", known[1]
    if state == "RUNNING" and "registering with controller" in text.lower():
        address = slurm.controller_address(slurm.load_settings())
        return (
            f"the engines of job {job_id} run and tried to register, but never reached the controller at {address}",
            f"set controller_address in {path} to an address of this machine that compute nodes can reach "
            f"(this machine has {', '.join(slurm.host_addresses())}); ask the admins whether a firewall blocks it.",
        )
    if state == "RUNNING":
        return (
            f"the job {job_id} runs, but its engines have not even tried to register yet",
            "Python starts slowly from a busy shared file system or on busy nodes: give them longer "
            "(`ddlab doctor --timeout 600`, start(n, timeout=600)).",
        )
    return (
        f"the engines did not register.\n{_tail(text)}",
        f"read the engines' output above; check the settings in {path}.",
    )


def _tail(text: str, lines: int = 12) -> str:
    """The last non-empty lines of a message."""
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join(kept)


def _diagnose_start(profile: str, error: BaseException, cluster: object, timeout: float) -> tuple[str, str]:
    """What went wrong starting engines, and what to change."""
    if profile in ("slurm", "jupyterhub"):
        return _diagnose_slurm_start(error, cluster)
    text = str(error)
    known = _classify_mpiexec_output(text, 0, mpi.mpiexec_path())
    if known and "root" in known[0]:
        return known[0], "unset DDLAB_MPIEXEC (ddlab's own mpiexec gets the root permission), " + known[1]
    if known:
        return known
    longer = int(max(300, 3 * timeout))
    if "registered within" in text:
        return (
            f"{_tail(text, 3)}",
            f"the engines are still starting or cannot reach the controller on 127.0.0.1: give them longer "
            f"(`ddlab doctor --timeout {longer}`, start(n, timeout={longer})), close other "
            "busy programs, or start fewer engines; a firewall must allow connections on 127.0.0.1.",
        )
    if "exited before registering" in text:
        return _tail(
            text
        ), REPO_HINT + "; `python -m ddlab.runtime.mpi -n 2 python -c 'import mpi4py.MPI'` tests MPI alone."
    return _tail(text), REPO_HINT + "."


def _singletons_fix(profile: str) -> str:
    from . import slurm

    if profile == "local":
        return (
            "the mpiexec that started them is not mpi4py's MPI: unset DDLAB_MPIEXEC, or "
            f"{REPO_HINT} so mpiexec and mpi4py come from one MPI wheel."
        )
    return (
        f"srun started each engine without a PMI this MPI speaks ({mpi.implementation()}): "
        f'set launcher = "auto" in {slurm.settings_file()} (Open MPI: its own mpiexec; MPICH: srun --mpi=pmi2); '
        "`srun --mpi=list` shows what your Slurm offers."
    )


def check_engines(
    profile: str, n: int = 2, timeout: float = 120.0, nbytes: int = 8 << 20, repetitions: int = 10
) -> list[Finding]:
    """Start n engines on the profile, check they form one MPI job, time an allreduce, stop them."""
    from ..runtime import cluster as clusters

    if profile in ("slurm", "jupyterhub"):
        problem = _slurm_preflight(profile)
        if problem:
            return [problem]
    running = clusters.current()  # a notebook's own cluster: probe it rather than start a second one
    if running is not None and (running.profile, running.n) != (profile, n):
        return [
            Finding(
                "engines",
                WARN,
                f"this kernel already runs {running.n} engines on profile "
                f"{running.profile!r}; the doctor does not stop them",
                "run `ddlab doctor` in a terminal, or ddlab.runtime.cluster.stop() first.",
            )
        ]
    started = time.monotonic()
    cluster = None
    try:
        if running is None:
            cluster = clusters.make_cluster(n, profile)
            client = clusters.bring_up(cluster, n, timeout)
            how = f"up in {time.monotonic() - started:.1f} s"
        else:
            client, how = running.client, "already running"
        return _probe_engines(client, profile, n, how, nbytes, repetitions)
    except Exception as err:  # every failure becomes a finding with its fix
        what, fix = _diagnose_start(profile, err, cluster, timeout)
        return [Finding("engines", FAIL, f"{n} engines on profile {profile!r}: {what}", fix)]
    finally:
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.stop_cluster_sync()


def _probe_engines(client: Any, profile: str, n: int, how: str, nbytes: int, repetitions: int) -> list[Finding]:
    """One MPI world with engine id == rank, and a correct, timed allreduce."""
    view = client[:]
    ranks = view.apply_sync(_probe)
    sizes = sorted({r["size"] for r in ranks})
    hosts = sorted({r["host"] for r in ranks})
    if sizes == [1] and n > 1:
        return [
            Finding(
                "engines",
                FAIL,
                f"{n} engines registered, but each is alone in a 1-rank MPI world (singletons)",
                _singletons_fix(profile),
            )
        ]
    if sizes != [n] or sorted(client.ids) != sorted(r["rank"] for r in ranks):
        return [
            Finding(
                "engines",
                FAIL,
                f"engine ids {sorted(client.ids)} and MPI ranks/sizes {ranks} do not match",
                "stop the cluster (ddlab.runtime.cluster.stop()) and start it again; if it persists, "
                + REPO_HINT
                + ".",
            )
        ]
    found = [
        Finding(
            "engines",
            OK,
            f"{n} engines on profile {profile!r} {how}, ids = MPI ranks "
            f"0..{n - 1}, on {', '.join(hosts)} ({ranks[0]['library']})",
        )
    ]
    results = view.apply_sync(_allreduce, nbytes, repetitions)
    correct = all(ok for ok, _ in results)
    seconds = max(t for _, t in results)
    detail = f"{nbytes / 2**20:.0f} MiB over {n} ranks in {seconds * 1e3:.2f} ms (median of {repetitions})"
    if not correct:
        found.append(
            Finding(
                "allreduce",
                FAIL,
                detail + ": wrong sum",
                REPO_HINT + "; report this with the output of `ddlab doctor`.",
            )
        )
    else:
        found.append(Finding("allreduce", OK, detail + ", sum correct"))
    return found


# --- entry point --------------------------------------------------------------------


def run(profile: str | None = None, n: int = 2, timeout: float = 120.0, quiet: bool = False) -> Report:
    """Run every check (MPI installation, then n engines on the profile); print and return the report."""
    from ..runtime.cluster import default_profile

    profile = profile or default_profile()
    report = Report(profile, n)
    report.findings.append(check_python())
    report.findings += check_mpi_library()
    report.findings.append(check_ipyparallel())
    if all(f.status == OK for f in report.findings):
        report.findings.append(check_path_mpiexec(n))
        # On a cluster's login node, try a small local job; on a laptop, the labs' own size.
        report.findings.append(check_mpiexec_by_hand(n if profile == "local" else 2))
        report.findings.append(check_network(profile, n))
        report.findings += check_engines(profile, n, timeout)
    report.findings.append(check_fault_tolerance(profile))
    if not quiet:
        print(report, flush=True)
    return report
