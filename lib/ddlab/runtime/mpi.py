"""The MPI launcher of this environment: which mpiexec, which library, which flags.

Everything in ddlab that starts MPI processes (engines, multi-rank tests, benchmarks)
asks this module, so the venv's own mpiexec is used, never whatever is first on PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


class MPISetupError(RuntimeError):
    """The MPI launcher is missing or unusable; the message says how to fix it."""


def mpiexec_path() -> str:
    """The mpiexec beside this Python (the venv's), or $DDLAB_MPIEXEC if set."""
    override = os.environ.get("DDLAB_MPIEXEC")
    if override:
        return override
    candidate = Path(sys.executable).parent / "mpiexec"
    if candidate.exists():
        return str(candidate)
    on_path = shutil.which("mpiexec")
    hint = f" (the one on PATH, {on_path}, may belong to another MPI than mpi4py's)" if on_path else ""
    raise MPISetupError(
        f"No mpiexec next to {sys.executable}{hint}. Run `make setup` in the course "
        "folder to install the MPI wheel, or set DDLAB_MPIEXEC to the mpiexec that "
        "matches mpi4py."
    )


def launcher_path() -> str:
    """What starts ranks on this machine: mpiexec_path(), but for MPICH its mpiexec.gforker when beside it.

    MPICH's usual mpiexec (Hydra) listens for its proxies on every interface, a port anyone on the
    network may connect to; gforker forks the ranks itself and listens on nothing. $DDLAB_MPIEXEC wins.
    """
    exe = mpiexec_path()
    if os.environ.get("DDLAB_MPIEXEC") or implementation(exe) != "mpich":
        return exe
    gforker = Path(exe).with_name("mpiexec.gforker")
    return str(gforker) if gforker.exists() else exe


@functools.cache
def implementation(mpiexec: str | None = None) -> str:
    """'openmpi' or 'mpich', read from `mpiexec --version` without initialising MPI here."""
    exe = mpiexec or mpiexec_path()
    try:
        out = subprocess.run(
            [exe, "--version"], capture_output=True, text=True, timeout=30, env={**os.environ, **root_env()}
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise MPISetupError(f"`{exe} --version` failed: {err}. Reinstall with `make setup`.") from None
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text:
        return "mpich"
    raise MPISetupError(f"Cannot tell which MPI `{exe}` belongs to:\n{text[:500]}")


def root_env() -> dict[str, str]:
    """Variables Open MPI needs to run as root (containers, CI); empty for other users."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return {}


def rank_env(n: int) -> dict[str, str]:
    """Variables for n ranks on this machine (the single-host MPI environment): root permission, threads
    per rank, Open MPI quiet and quick to start, and no rank listening on the network.

    Math libraries (OpenMP, torch) default to one thread per core in every rank, so
    4 ranks on 2 cores would run 8 threads fighting for 2 cores; give each rank its share.
    Ranks on one host talk through shared memory; a TCP transport would only open a port on
    every interface of every rank, which anyone on the network (a campus's, a café's) may
    connect to unauthenticated. A variable the user set already wins over each of these.
    Multi-host runs (the Slurm and JupyterHub profiles) use network_env instead.
    """
    threads = str(max(1, (os.cpu_count() or 1) // n))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if implementation() == "openmpi":
        # Open MPI's UCX one-sided component prints an error on every rank that opens an MPI.Win
        # on a machine without UCX devices (lab 11's slow link), then falls back; skip it.
        env["OMPI_MCA_osc"] = "^ucx"
        # Shared memory (and self) only: no TCP listener per rank, and no libfabric probing for a
        # network fabric (about 1 s of every MPI_Init on every rank).
        env["OMPI_MCA_btl"] = "self,sm"
    else:
        # MPICH's UCX netmod (the wheel's default): every transport UCX would pick but TCP, so the ranks
        # keep its shared-memory and copy transports; its OFI netmod on libfabric's shared-memory provider.
        # Either way no rank listens on TCP.
        env["UCX_TLS"] = "^tcp"
        env["FI_PROVIDER"] = "shm"
    return {**{name: os.environ.get(name, value) for name, value in env.items()}, **root_env()}


#: The variables that choose where MPI's TCP traffic goes, per implementation (network_env sets them).
INTERFACE_VARIABLES = {
    "openmpi": ("OMPI_MCA_btl_tcp_if_include", "PRTE_MCA_prte_if_include"),
    "mpich": ("UCX_NET_DEVICES", "FI_TCP_IFACE", "HYDRA_IFACE"),
}


def network_env(interface: str) -> dict[str, str]:
    """Variables for ranks on several hosts: MPI's TCP traffic on `interface` (e.g. "ib0", "eth1"), or
    on every interface when it is "" (the Slurm settings' `network_interface`, see clusters/slurm/settings.py).

    Open MPI: its TCP transport on that interface (btl_tcp_if_include) and its launcher's
    out-of-band messages too (prte_if_include, formerly oob_tcp_if_include). MPICH: UCX_NET_DEVICES,
    libfabric's FI_TCP_IFACE and Hydra's HYDRA_IFACE. The transports themselves stay the site's
    (a cluster's fabric is its business). A variable the user set already wins.
    """
    names = INTERFACE_VARIABLES[implementation()] if interface else ()
    return {name: os.environ.get(name, interface) for name in names}


def rank_interfaces(env: Mapping[str, str]) -> str | None:
    """Where ranks started with `env` listen for TCP: None (shared memory only, no listener), "" (every
    interface) or the interfaces MPI was told to use (e.g. "ib0", or "every interface but ..." for an exclusion)."""
    if implementation() == "openmpi":
        if _leaves_out_tcp(env.get("OMPI_MCA_btl", "")):
            return None
        include, exclude = env.get("OMPI_MCA_btl_tcp_if_include", ""), env.get("OMPI_MCA_btl_tcp_if_exclude", "")
    else:
        if _leaves_out_tcp(env.get("UCX_TLS", "")):
            return None
        include, exclude = env.get("UCX_NET_DEVICES", ""), ""
    return include or (f"every interface but {exclude}" if exclude else "")


def _leaves_out_tcp(transports: str) -> bool:
    """True when a transport list (Open MPI's btl, UCX's TLS: "a,b" chooses, "^a,b" excludes) has no TCP."""
    value = transports.replace(" ", "")
    named = set(value.lstrip("^").split(","))
    if value.startswith("^"):
        return "tcp" in named
    return bool(value) and not named & {"tcp", "all"}


def launch_env(n: int = 1) -> dict[str, str]:
    """The environment for mpiexec -n n: this process's, plus rank_env(n)."""
    return {**os.environ, **rank_env(n)}


def launcher_args(n: int, fault_tolerant: bool = False) -> list[str]:
    """Flags mpiexec needs to start n ranks on this machine, whatever its core count.

    fault_tolerant: launch with User-Level Failure Mitigation (ULFM), so that a rank's death is an
    error the others can handle (revoke, shrink, agree) instead of the end of the job; Open MPI 5
    only (`ulfm_problem()` says what to do elsewhere)."""
    if fault_tolerant and (problem := ulfm_problem()):
        raise MPISetupError(problem)
    if implementation() == "openmpi":
        # Open MPI refuses more ranks than cores unless told; it then yields when idle.
        flags = ["--oversubscribe"] if n > (os.cpu_count() or 1) else []
        return [*flags, "--with-ft", "ulfm"] if fault_tolerant else flags
    return []


@functools.cache
def ulfm_problem(mpiexec: str | None = None) -> str | None:
    """None if this MPI can run fault-tolerant jobs (ULFM), else why not and what to do."""
    exe = mpiexec or mpiexec_path()
    if implementation(exe) != "openmpi":
        return (
            f"{exe} is MPICH's: ddlab's fault-tolerant jobs (ULFM: Comm.Revoke, Shrink, Agree) need Open MPI 5. "
            "Set up with Open MPI (`make clean && make setup MPI=openmpi`), or on a cluster load an Open MPI 5 "
            "module built with ULFM (`ompi_info` says 'FT MPI support: yes')."
        )
    info = Path(exe).with_name("ompi_info")
    try:
        out = subprocess.run(
            [str(info)], capture_output=True, text=True, timeout=60, env={**os.environ, **root_env()}
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"`{info}` failed ({err}), so ULFM support is unknown: reinstall with `make setup`."
    if "FT MPI support: yes" not in out:
        return (
            f"this Open MPI ({info}) was built without ULFM ('FT MPI support' is not 'yes'): use Open MPI 5 "
            "from `make setup` (its wheel has it), or a site module built with --with-ft=ulfm."
        )
    return None


def mpiexec_command(n: int, fault_tolerant: bool = False) -> list[str]:
    """The command prefix that starts n ranks: [mpiexec, -n, n, flags...]; stale sessions are cleared first."""
    if n < 1:
        raise ValueError(f"need at least one rank, got n={n}")
    clear_stale_sessions()
    return [launcher_path(), "-n", str(n), *launcher_args(n, fault_tolerant)]


#: Seconds by which a process may seem to predate its own session directory (psutil's start times
#: are computed from the boot time, which /proc gives in whole seconds).
_CLOCK_SLACK = 2.0


def clear_stale_sessions(base: str | None = None) -> list[Path]:
    """Remove the session directories of Open MPI jobs that were killed; return them. Call before mpiexec.

    Open MPI's mpiexec keeps its session in <tmp>/ompi.<its pid> and removes it when it ends.
    Killed (a timed-out test, a dead kernel's engines, `kill -9`), it leaves the directory
    behind, and a later mpiexec that is given the same pid (pids wrap at pid_max) finds the
    old rendezvous files there and refuses to start: "The PMIx server's listener thread
    failed to start". A directory of this user's is stale when no process has its pid, or
    the process that has it started after the directory last changed (the pid was reused).
    Other MPIs keep no such directory: nothing is removed for them.
    """
    import psutil

    root = Path(base or os.environ.get("PRTE_MCA_prte_tmpdir_base") or tempfile.gettempdir())
    removed = []
    for path in root.glob("ompi.*"):
        pid = path.name.removeprefix("ompi.")
        try:
            status = path.stat()
            if not pid.isdigit() or status.st_uid != os.geteuid():
                continue
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(int(pid)).create_time() <= status.st_ctime + _CLOCK_SLACK:
                    continue  # its mpiexec is running
        except (OSError, psutil.Error):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def kill_session(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop mpiexec (started with start_new_session) and every process of its session.

    mpiexec gets SIGTERM first so it can stop its ranks; whatever is left of the
    session after `grace` seconds is killed (Open MPI puts ranks in process groups
    of their own, so killing one group is not enough).
    """
    import psutil

    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    for other in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(other.pid) == proc.pid:
                other.kill()


#: Seconds the launcher has to exit on its own once every rank it started has exited (`run_ranks`' `ended`).
LAUNCHER_GRACE = 5.0
#: Seconds between two looks at whether the ranks have ended.
POLL = 0.2


def run_ranks(
    n: int,
    command: list[str],
    timeout: float | None = None,
    fault_tolerant: bool = False,
    ended: Callable[[], bool] | None = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """Run `command` on n ranks; on timeout kill mpiexec and every rank it started.

    fault_tolerant: launch with ULFM (see launcher_args), so ranks survive another rank's death.
    ended: whether every rank has exited; once it says so, mpiexec has LAUNCHER_GRACE seconds to exit before
    it is stopped (under ULFM, after a rank's death, the launcher may outlive the ranks it waits for).
    Output is captured (text) unless `stdout`/`stderr` are given. Raises
    subprocess.TimeoutExpired, with whatever was printed, after killing the job.
    """
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.STDOUT)
    proc = subprocess.Popen(
        mpiexec_command(n, fault_tolerant) + command, env=launch_env(n), text=True, start_new_session=True, **kwargs
    )
    deadline = None if timeout is None else time.monotonic() + timeout
    since: float | None = None  # when `ended` first said every rank had exited
    try:
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if ended is not None:  # look at the ranks every POLL seconds
                left = POLL if left is None else min(POLL, left)
            try:
                out, err = proc.communicate(timeout=left)
                break
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                if since is None and ended is not None and ended():
                    since = time.monotonic()
                if since is not None and time.monotonic() - since > LAUNCHER_GRACE:
                    kill_session(proc)
                    out, err = proc.communicate()
                    break
    except subprocess.TimeoutExpired:
        kill_session(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout or 0.0, output=out, stderr=err) from None
    except BaseException:  # Ctrl-C, or SIGTERM made SystemExit by `main`: take mpiexec and its ranks down too
        kill_session(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_for_each(rank_counts: list[int], command: list[str], timeout: float) -> int:
    """Run command on each rank count in turn, printing what it printed; 0 if all succeeded."""
    status = 0
    for n in rank_counts:
        try:
            done = run_ranks(n, command, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            print(f"{n} ranks: killed after {timeout} s\n{err.output or ''}")
            return 1
        print(done.stdout, end="")
        status = status or done.returncode
    return status


def bench_main(
    parser: argparse.ArgumentParser,
    child: Callable[[argparse.Namespace], None],
    timeout: float,
    ranks: list[int] | None = None,
) -> int:
    """A benchmark's main: rerun this script, same arguments, under mpiexec; there, call `child`.

    Run directly, the script relaunches itself with `--child` on each rank count in turn
    (its own `--ranks` option if it has one, else `ranks`, else 4) and prints what rank 0
    printed; inside the MPI job, `child(args)` measures.
    """
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    command = [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:], "--child"]
    return run_for_each(getattr(args, "ranks", None) or ranks or [4], command, timeout)


def main(argv: list[str] | None = None) -> int:
    """`python -m ddlab.runtime.mpi -n 4 CMD...`: run CMD on n ranks with this environment's MPI."""
    parser = argparse.ArgumentParser(prog="python -m ddlab.runtime.mpi", description=main.__doc__)
    parser.add_argument("-n", type=int, default=4, help="number of ranks")
    parser.add_argument("--timeout", type=float, default=None, help="kill the job after this many seconds")
    parser.add_argument(
        "--fault-tolerant", action="store_true", help="launch with ULFM: ranks survive another's death (Open MPI 5)"
    )
    parser.add_argument(
        "--clear-stale", action="store_true", help="only remove what killed Open MPI jobs left (clear_stale_sessions)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.clear_stale and not args.command:
        clear_stale_sessions()
        return 0
    if not args.command:
        parser.error("give a command to run, e.g. python -m ddlab.runtime.mpi -n 4 python script.py")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed launcher leaves no ranks behind
    try:
        return run_ranks(args.n, args.command, args.timeout, args.fault_tolerant, stdout=None, stderr=None).returncode
    except subprocess.TimeoutExpired:
        print(f"ddlab.runtime.mpi: killed after {args.timeout} s", file=sys.stderr)
        return 124


if __name__ == "__main__":
    sys.exit(main())
