"""Start, stop and restart a cluster of MPI engines, quietly and with a way out.

    rc = ddlab.runtime.cluster.start(n=4)      # %px / %%px now run on 4 MPI ranks
    ddlab.runtime.cluster.restart()            # after a hang or a crashed engine
    ddlab.runtime.cluster.stop()

    rc = ddlab.runtime.cluster.start(n=4, fault_tolerant=True)  # ULFM: a dead engine leaves the others running

A profile is a folder of `clusters/` (local, slurm, jupyterhub) holding an
`ipcluster_config.py`. Runtime files (connection files, logs) live in the user's
IPython directory under `profile_ddlab-<profile>`, never in the course folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import ipyparallel as ipp
import psutil
from traitlets.config import Config, PyFileConfigLoader

from . import mpi, reaper

#: Where `clusters/` lives: next to lib/ in the course folder, or $DDLAB_CLUSTERS.
CLUSTERS_DIR = Path(os.environ.get("DDLAB_CLUSTERS", Path(__file__).resolve().parents[3] / "clusters"))

_ID_PREFIX = "ddlab-"


class ClusterError(RuntimeError):
    """The engines did not start or stopped; the message says why and what to do."""


@dataclass
class Running:
    """The cluster this process started: ipyparallel's cluster and client, its view, n, profile and reaper."""

    cluster: ipp.Cluster
    client: ipp.Client
    view: ipp.DirectView
    n: int
    profile: str
    reaper: subprocess.Popen  # stops the cluster if this process dies without stop()
    fault_tolerant: bool = False  # launched with ULFM: the survivors of a dead engine keep running
    reported_up: int = -1  # engine count at the last crash report, so each crash is told once
    killed: set[int] = field(default_factory=set)  # engines kill_engine() killed on purpose, until restart()

    def healthy(self) -> bool:
        """Whether every engine is up but those killed on purpose (lab 19 goes on without them)."""
        up = set(self.client.ids)
        return len(up) == self.n - len(self.killed) and not up & self.killed


_current: Running | None = None


def default_profile() -> str:
    """The profile used when none is given: $DDLAB_PROFILE (e.g. slurm on a cluster), else local."""
    return os.environ.get("DDLAB_PROFILE") or "local"


def profile_config(profile: str) -> Config:
    """The ipyparallel configuration of `clusters/<profile>/ipcluster_config.py`."""
    folder = CLUSTERS_DIR / profile
    config_file = folder / "ipcluster_config.py"
    if not config_file.exists():
        known = sorted(p.name for p in CLUSTERS_DIR.glob("*/ipcluster_config.py") for p in [p.parent])
        raise ClusterError(
            f"No cluster profile {profile!r}: {config_file} does not exist. "
            f"Known profiles: {', '.join(known) or 'none'} (in {CLUSTERS_DIR})."
        )
    return PyFileConfigLoader(config_file.name, path=str(folder)).load_config()


def current() -> Running | None:
    """The cluster this process started with start() and has not stopped, or None."""
    return _current


#: The controller pings engines twice a second, not every 3 s (ipyparallel's default), and counts an engine
#: dead after 60 missed pings, 30 s as before: an engine registers only once its heart has answered,
#: so 4 local engines register in about 5 s instead of 9.
HEARTBEAT = ["--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=60"]


def make_cluster(n: int, profile: str, fault_tolerant: bool = False) -> ipp.Cluster:
    """An ipyparallel cluster of n MPI engines on the profile, not started (bring_up starts it).

    fault_tolerant: the engines' mpiexec runs with ULFM (`--with-ft ulfm`, Open MPI 5), so an engine's
    death is an error the others' MPI calls return, not the end of them all. Every profile honours it:
    the local one through `mpi.launcher_args`, the Slurm and JupyterHub launchers through their
    `fault_tolerant` setting (`ddlab.tools.slurm`). On an MPI without ULFM it raises ClusterError.
    """
    if fault_tolerant and (problem := mpi.ulfm_problem()):
        raise ClusterError(f"A fault-tolerant cluster cannot start: {problem}")
    config = profile_config(profile)
    mpi.clear_stale_sessions()
    config.MPILauncher.mpi_cmd = [mpi.launcher_path()]
    config.MPILauncher.mpi_args = mpi.launcher_args(n, fault_tolerant)
    config.SlurmEngines.fault_tolerant = config.AllocationEngines.fault_tolerant = fault_tolerant
    if config.Cluster.get("engine_launcher_class") == "mpi":  # every engine on this host (the local profile)
        config.MPILauncher.environment = mpi.rank_env(n)
    config.Cluster.controller_args = [*config.Cluster.get("controller_args", []), *HEARTBEAT]
    return ipp.Cluster(
        profile=f"ddlab-{profile}",
        cluster_id=f"{_ID_PREFIX}{os.getpid()}",
        n=n,
        config=config,
        log_level=logging.ERROR,
        shutdown_atexit=True,
    )


def cleanup_orphans(profile: str | None = None) -> list[str]:
    """Stop clusters of this profile whose notebook kernel has died; return their ids.

    ddlab names each cluster after the pid of the process that started it, so a
    cluster whose owner is gone is an orphan. The reaper each start() leaves behind
    removes a dead kernel's cluster within seconds; this finds what escaped it
    (a reaper killed too, a machine that rebooted) and clusters this process left.
    """
    from IPython.paths import get_ipython_dir

    profile_dir = Path(get_ipython_dir()) / f"profile_ddlab-{profile or default_profile()}"
    stopped = []
    for record in sorted((profile_dir / "security").glob(f"cluster-{_ID_PREFIX}*.json")):
        cluster_id = record.stem[len("cluster-") :]
        owner = cluster_id[len(_ID_PREFIX) :]
        if owner.isdigit() and (int(owner) == os.getpid() or not psutil.pid_exists(int(owner))):
            reaper.reap(str(profile_dir), cluster_id)
            stopped.append(cluster_id)
    return stopped


# ipyparallel's own log lines ("2026-01-31 12:00:00.123 [IPEngine.0] ..."), unless errors.
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \[[^\]]+\] (?!.*(ERROR|CRITICAL))")


def _engine_output(cluster: ipp.Cluster, lines: int = 15) -> str:
    """The last lines the engines and mpiexec printed (not ipyparallel's chatter)."""
    text = ""
    for engine_set in cluster.engines.values():
        with contextlib.suppress(Exception):
            text += engine_set.get_output() or ""
    kept = [line for line in text.splitlines() if line.strip() and not _LOG_LINE.match(line)]
    return "\n".join("    " + line for line in kept[-lines:]) or "    (nothing besides ipyparallel's log)"


def _engines_alive(cluster: ipp.Cluster) -> bool:
    """True while the engines' launcher (mpiexec, or a batch job) has not exited."""
    for engine_set in cluster.engines.values():
        process = getattr(engine_set, "process", None)  # batch launchers have none
        if process is None:  # ask the batch system: poll() is None while queued or running
            if engine_set.poll() is None:
                return True
            continue
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


class EnginesView(ipp.DirectView):
    """A blocking view on engines 0..n-1 that refuses to run once one of them has died, naming it.

    A view on "all" would quietly run on the survivors of a fault-tolerant cluster, whose
    COMM_WORLD still holds the dead rank. This one raises ClusterError instead, at once, saying
    which engine died and the two ways on: the survivors' own view, or `restart()`.
    """

    def _refuse_dead(self, targets: Any) -> None:
        """Raise ClusterError if an engine of `targets` (a call's own, else the view's) has died."""
        targets = self.targets if targets is None else targets
        targets = [targets] if isinstance(targets, int) else targets
        if not isinstance(targets, (list, tuple, range)):
            return  # "all" or a slice: ipyparallel resolves them among the engines that are up
        gone = sorted(set(targets) - set(self.client.ids))
        if gone:
            alive = sorted(set(self.targets) - set(gone))
            raise ClusterError(
                f"Engine {', '.join(map(str, gone))} (MPI rank {', '.join(map(str, gone))}) died: "
                f"this view runs on all {len(self.targets)} engines. The survivors {alive} still run "
                f"(fault-tolerant MPI): use rc[{alive}] on them, and shrink their COMM_WORLD "
                "(lab 19); or bring all engines back with ddlab.runtime.cluster.restart()."
            )

    def _really_apply(self, f: Any, args: Any = None, kwargs: Any = None, targets: Any = None, **options: Any) -> Any:
        self._refuse_dead(targets)
        return super()._really_apply(f, args, kwargs, targets=targets, **options)

    def execute(self, code: str, silent: bool = True, targets: Any = None, **options: Any) -> Any:
        self._refuse_dead(targets)
        return super().execute(code, silent, targets=targets, **options)


def _activate(client: ipp.Client, n: int, fault_tolerant: bool) -> ipp.DirectView:
    """A blocking view on all engines, registered for %px/%%px when running in IPython.

    fault_tolerant: the view is an EnginesView on engines 0..n-1 (an engine's id is its MPI rank),
    which names a dead engine instead of running on the survivors alone.
    No progress bars in %px cells: they make notebook output change from run to run.
    The magic shows one only after `progress_after_seconds`; a value of -1 would also
    skip its wait for the engines' last output, so use a wait longer than any cell.
    """
    from ipyparallel.client.magics import ParallelMagics
    from IPython import get_ipython

    if fault_tolerant:
        view: ipp.DirectView = EnginesView(client=client, socket=client._mux_stream, targets=list(range(n)))
    else:
        view = client.direct_view("all")  # blocking, as every view of the client
    if get_ipython() is not None:
        ParallelMagics.progress_after_seconds = 1e6
        view.activate()
    return view


def _wait_for_engines(cluster: ipp.Cluster, client: ipp.Client, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(client.ids) < n:
        if not _engines_alive(cluster):
            raise ClusterError(
                f"The MPI engines exited before registering ({len(client.ids)} of {n} up). "
                f"Their last output:\n{_engine_output(cluster)}\n"
                "If mpi4py cannot initialise MPI, run `make setup` again; "
                "`python -m ddlab.runtime.mpi -n 2 python -c 'import mpi4py.MPI'` tests MPI alone."
            )
        if time.monotonic() > deadline:
            raise ClusterError(
                f"Only {len(client.ids)} of {n} engines registered within {timeout:.0f} s. "
                f"Their last output:\n{_engine_output(cluster)}\n"
                "On a busy or small machine pass a longer timeout, e.g. start(n, timeout=180), "
                "or start fewer engines."
            )
        time.sleep(0.1)  # engine (un)registrations arrive on the client's IO thread


def bring_up(cluster: ipp.Cluster, n: int, timeout: float) -> ipp.Client:
    """Start the controller and n engines of `cluster`; return a client once all registered.

    The client's views block by default (`rc[:].pull("x")` returns the values, not
    an AsyncResult). Raises ClusterError (or ipyparallel's error) saying what went
    wrong; the caller stops the cluster then.
    """
    cluster.start_controller_sync()
    # Connect before starting engines: that waits until the controller is fully up, and a
    # controller stopped earlier (sbatch refusing the engines' job fails at once) leaves its
    # schedulers running. ipyparallel's default 10 s to connect is short on a loaded machine.
    client = cluster.connect_client_sync(timeout=max(10.0, min(timeout, 60.0)))
    client.block = True  # views take it as their default
    try:
        cluster.start_engines_sync(n)
        _wait_for_engines(cluster, client, n, timeout)
    except BaseException:
        client.close()
        raise
    return client


def start(n: int = 4, profile: str | None = None, timeout: float = 120.0, fault_tolerant: bool = False) -> ipp.Client:
    """Start n MPI engines and return a client (its views block) whose view is active for %px and %%px.

    The profile is a folder of clusters/ (default: $DDLAB_PROFILE, else local).
    fault_tolerant: launch the engines' MPI with ULFM (lab 19): an engine killed leaves the others
    running, their MPI calls return errors, and the active view names the dead engine (EnginesView).
    Running it again with the same n, profile and fault_tolerant returns the running cluster; with
    other values it stops the old one first. Orphans of killed kernels are stopped.
    """
    global _current
    profile = profile or default_profile()
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive number of engines, got {n!r}")
    if _current is not None:
        same = (_current.n, _current.profile, _current.fault_tolerant) == (n, profile, fault_tolerant)
        if same and len(_current.client.ids) == n:
            return _current.client
        stop()
    cleanup_orphans(profile)
    cluster = make_cluster(n, profile, fault_tolerant)
    watcher = reaper.start_watching(cluster.profile_dir, cluster.cluster_id)
    try:
        client = bring_up(cluster, n, timeout)
    except BaseException:
        _shut_down(cluster, watcher)
        raise
    _current = Running(cluster, client, _activate(client, n, fault_tolerant), n, profile, watcher, fault_tolerant)
    _watch_engines()
    return client


def _shut_down(cluster: ipp.Cluster, watcher: subprocess.Popen) -> None:
    """Stop the cluster and return once none of its processes is left on this machine; then end its reaper.

    ipyparallel's stop signals mpiexec and the controller; engines that mpiexec could not
    take down in time (it is killed after five seconds) and nannies still saying goodbye
    to a stopped controller are killed here, so nothing outlives stop().
    """
    with contextlib.suppress(Exception):  # whatever it could not stop is killed below
        cluster.stop_cluster_sync()
    survivors = reaper.kill(cluster.profile_dir, cluster.cluster_id)
    watcher.terminate()
    watcher.wait()
    if survivors:
        raise ClusterError(f"Processes of the cluster survived SIGKILL: {[p.pid for p in survivors]}.")


def stop() -> None:
    """Stop the engines and the controller of the running cluster (if any); return when they are gone."""
    global _current
    running, _current = _current, None
    if running is None:
        return
    with contextlib.suppress(Exception):
        running.client.close()
    _shut_down(running.cluster, running.reaper)


def restart(timeout: float = 120.0) -> ipp.Client:
    """Kill the engines (hung in MPI, or crashed) and start as many fresh ones.

    The notebook's own variables survive; the engines' do not, so rerun the
    cells that set them up (imports, `comm = MPI.COMM_WORLD`, ...).
    """
    if _current is None:
        raise ClusterError("No cluster is running: start one with ddlab.runtime.cluster.start(n=4).")
    running = _current
    cluster, client, n = running.cluster, running.client, running.n
    cluster.stop_engines_sync()
    # Forget the old engines so their ids and queued tasks do not linger.
    deadline = time.monotonic() + 30
    while client.ids and time.monotonic() < deadline:
        time.sleep(0.1)  # engine (un)registrations arrive on the client's IO thread
    cluster.start_engines_sync(n)
    try:
        _wait_for_engines(cluster, client, n, timeout)
    except ClusterError:
        stop()
        raise
    running.view = _activate(client, n, running.fault_tolerant)
    running.killed.clear()
    return client


def kill_engine(engine: int, timeout: float = 30.0) -> None:
    """SIGKILL one engine of the running cluster, as a hardware fault would; return once the controller knows.

    The engine's nanny sends the signal, so this works wherever the engine runs (a compute node
    too). On a fault-tolerant cluster (lab 19) the other engines go on and the active view names
    the dead one; on any other, MPI ends the whole job. `restart()` brings the engines back.
    """
    if _current is None:
        raise ClusterError("No cluster is running: start one with ddlab.runtime.cluster.start(n=4).")
    client = _current.client
    if engine not in client.ids:
        raise ValueError(f"No engine {engine!r} is up: the engines up are {sorted(client.ids)}.")
    client.send_signal("SIGKILL", targets=[engine], block=True)
    deadline = time.monotonic() + timeout
    while engine in client.ids:  # its nanny tells the controller
        if time.monotonic() > deadline:
            raise ClusterError(
                f"Engine {engine} was sent SIGKILL but is still registered after {timeout:.0f} s: "
                "run ddlab.runtime.cluster.restart()."
            )
        time.sleep(0.1)  # engine (un)registrations arrive on the client's IO thread
    _current.reported_up = len(client.ids)  # this death was asked for: the cell after it need not report it
    _current.killed.add(engine)


@contextlib.contextmanager
def running(
    n: int = 4, profile: str | None = None, timeout: float = 120.0, fault_tolerant: bool = False
) -> Iterator[ipp.Client]:
    """`with ddlab.runtime.cluster.running(4) as rc:` starts a cluster and always stops it."""
    client = start(n, profile, timeout, fault_tolerant)
    try:
        yield client
    finally:
        stop()


def status() -> str:
    """One line on the running cluster: how many engines are up, and what to do if not."""
    if _current is None:
        return "No cluster is running: start one with ddlab.runtime.cluster.start(n=4)."
    up, n = len(_current.client.ids), _current.n
    if up == n:
        ft = ", fault-tolerant (ULFM)" if _current.fault_tolerant else ""
        return f"{n} engines up (MPI ranks 0..{n - 1}), profile {_current.profile!r}{ft}."
    if _current.fault_tolerant and up:
        alive = sorted(_current.client.ids)
        gone = sorted(set(range(n)) - set(alive))
        return (
            f"Engine {', '.join(map(str, gone))} died; the survivors {alive} still run (fault-tolerant MPI). "
            f"Run on them with rc[{alive}] and shrink their COMM_WORLD (lab 19), or run "
            "ddlab.runtime.cluster.restart() to start all engines afresh (the notebook's variables stay)."
        )
    return (
        f"Only {up} of {n} engines are up: an engine crashed and MPI ended the job. "
        f"Last engine output:\n{_engine_output(_current.cluster)}\n"
        "Run ddlab.runtime.cluster.restart() to start fresh engines (the notebook's variables stay)."
    )


def _report_dead_engines(*_args: object) -> None:
    """After each notebook cell: if engines died since the last report, say so, with the way out."""
    if _current is None:
        return
    up = len(_current.client.ids)
    if up < _current.n and up != _current.reported_up:
        print(status(), file=sys.stderr)
    _current.reported_up = up


def _watch_engines() -> None:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return
    callbacks = shell.events.callbacks["post_run_cell"]
    if _report_dead_engines not in callbacks:
        shell.events.register("post_run_cell", _report_dead_engines)
