"""What keeps other users out: on one host nothing the cluster or an MPI job starts listens beyond
loopback, connection files are for their owner's eyes only, and every message stays signed.
"""

from __future__ import annotations

import ipaddress
import json
import stat
import subprocess
import sys
from pathlib import Path

import ddlab.runtime.cluster
import psutil
import pytest
import zmq
from ddlab.tools import slurm
from jupyter_client.session import Session

LIBRARY = Path(ddlab.runtime.cluster.__file__).parent


#: Open MPI's launcher (prterun of PRRTE 3.0, the wheel's) binds its out-of-band port to every interface,
#: IPv4 and IPv6, whatever prte_if_include says: its listener binds INADDR_ANY and in6addr_any, and its
#: interface list drops loopback whenever another interface exists, so no setting keeps it on loopback.
#: The one exception allowed, for the launcher process itself and nothing it starts (docs/hpc.md).
UNBOUND_LAUNCHER = ("prterun", {"0.0.0.0", "::"})


@pytest.fixture(scope="module")
def local_cluster():
    """Four engines on the local profile, with the files their controller wrote."""
    with ddlab.runtime.cluster.running(4, "local") as client:
        yield client, ddlab.runtime.cluster._current.cluster


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or address).is_loopback


def beyond_loopback(roots: list[psutil.Process]) -> list[str]:
    """Listening sockets of these processes and all their children on anything but loopback, as "pid name ip:port"."""
    found = []
    for root in roots:
        for proc in [root, *root.children(recursive=True)]:
            for conn in proc.net_connections(kind="inet"):
                if conn.status != psutil.CONN_LISTEN or _is_loopback(conn.laddr.ip):
                    continue
                if proc == root and proc.name() == UNBOUND_LAUNCHER[0] and conn.laddr.ip in UNBOUND_LAUNCHER[1]:
                    continue
                found.append(f"{proc.pid} {proc.name()} {conn.laddr.ip}:{conn.laddr.port}")
    return found


def test_nothing_the_local_cluster_started_listens_beyond_loopback(local_cluster) -> None:
    """Controller, mpiexec, engines and their children, after a collective: loopback only (MPI over shared memory)."""
    client, cluster = local_cluster
    view = client[:]
    view.execute("from mpi4py import MPI; _total = MPI.COMM_WORLD.allreduce(1)", block=True)
    assert view.pull("_total", block=True) == [4] * 4
    launchers = [psutil.Process(launcher.process.pid) for launcher in cluster.engines.values()]
    roots = [psutil.Process(cluster.controller.process.pid), *launchers]
    assert sum(len(root.children(recursive=True)) for root in launchers) >= 4, "no engine found under mpiexec"
    assert beyond_loopback(roots) == [], "listening beyond loopback"


_RANK = """
import os, sys, time
from mpi4py import MPI
total = MPI.COMM_WORLD.allreduce(1)
print(f"ready {total}", flush=True)
deadline = time.monotonic() + 60
while MPI.COMM_WORLD.rank == 0 and not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)  # until the test has looked
MPI.COMM_WORLD.Barrier()
"""

#: Before _RANK: torch's gloo on the MPI ranks, as labs 04-16 start it to compare with torch, and one allreduce.
_GLOO = """
import torch, torch.distributed
from mpi4py import MPI
from ddlab.data_parallel import init_gloo
init_gloo(MPI.COMM_WORLD)
torch.distributed.all_reduce(torch.ones(1))
"""


def _listening_of_a_job(tmp_path: Path, n: int, setup: str = "") -> list[str]:
    """Run `setup`, a collective, then wait, on n ranks of `python -m ddlab.runtime.mpi`; what they listen on."""
    looked = tmp_path / "looked"
    command = [sys.executable, "-c", setup + _RANK, str(looked)]
    job = subprocess.Popen(
        [sys.executable, "-m", "ddlab.runtime.mpi", "-n", str(n), "--timeout", "120", *command],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert job.stdout is not None
    try:
        seen, ready = "", f"ready {n}"  # MPICH's gforker may interleave the ranks' lines
        while seen.count(ready) < n and (line := job.stdout.readline()):  # the launcher's --timeout bounds it
            seen += line
        assert seen.count(ready) == n, seen
        launcher = psutil.Process(job.pid)
        mpiexec = launcher.children()
        assert len(launcher.children(recursive=True)) >= n + 1, "no ranks found under mpiexec"
        found = beyond_loopback(mpiexec)
        looked.touch()
        assert job.wait(60) == 0
        return found
    finally:
        job.kill()
        job.wait(30)


def test_nothing_an_mpi_job_started_listens_beyond_loopback(tmp_path: Path) -> None:
    """`python -m ddlab.runtime.mpi -n 4`, the launcher of the benches and multi-rank tests: the same."""
    assert _listening_of_a_job(tmp_path, 4) == [], "listening beyond loopback"


def test_torch_gloo_on_one_host_listens_on_loopback_only(tmp_path: Path) -> None:
    """init_gloo's rendezvous and gloo's connections (2 ranks: importing torch is the slow part)."""
    assert _listening_of_a_job(tmp_path, 2, _GLOO) == [], "listening beyond loopback"


def _security_dir(cluster) -> Path:
    return Path(cluster.profile_dir) / "security"


def _connection_files(cluster) -> list[Path]:
    files = sorted(_security_dir(cluster).glob(f"ipcontroller-{cluster.cluster_id}-*.json"))
    assert {f.name.rsplit("-", 1)[1] for f in files} == {"client.json", "engine.json"}
    return files


def test_the_local_controller_listens_on_loopback_only(local_cluster) -> None:
    _, cluster = local_cluster
    controller = psutil.Process(cluster.controller.process.pid)
    listening = [
        (proc.pid, conn.laddr.ip)
        for proc in [controller, *controller.children(recursive=True)]
        for conn in proc.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]
    assert listening, "the controller listens on nothing?"
    assert {ip for _, ip in listening} == {"127.0.0.1"}, listening
    for path in _connection_files(cluster):
        assert json.loads(path.read_text())["interface"] == "tcp://127.0.0.1"


def test_connection_files_are_readable_by_their_owner_only(local_cluster) -> None:
    _, cluster = local_cluster
    assert stat.S_IMODE(_security_dir(cluster).stat().st_mode) == 0o700
    for path in _connection_files(cluster):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # The cluster file beside them (pids and paths, for cleanup) holds no secret.
    key = json.loads(_connection_files(cluster)[0].read_text())["key"]
    assert key not in Path(cluster.cluster_file).read_text()


def test_engines_refuse_a_message_not_signed_with_the_clusters_key(local_cluster) -> None:
    """An execute request signed with another key, sent where the client sends its own, runs nowhere; the same
    request signed with the cluster's key runs (so the path is right and the refusal is the signature's)."""
    client, _ = local_cluster
    target = client._engines[0].encode()

    def send(key: bytes, code: str) -> zmq.Socket:
        session = Session(key=key, signature_scheme="hmac-sha256", username=client.session.username)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(client._config["mux"])
        content = {"code": code, "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False}
        session.send(sock, "execute_request", content=content, ident=target)
        return sock

    forged = send(b"not the cluster's key, 32 bytes.", "_forged_ran = True")
    signed = send(client.session.key, "_signed_ran = True")
    try:
        assert signed.poll(30_000), "no reply to the signed request in 30 s"
        assert not forged.poll(0), "the engine answered a request signed with another key"
        view = client[[0]]
        view.execute("_ran = ('_signed_ran' in dir(), '_forged_ran' in dir())", block=True)
        assert view.pull("_ran", block=True) == [(True, False)]
    finally:
        forged.close()
        signed.close()


def test_messages_are_signed_with_a_secret_key(local_cluster) -> None:
    client, cluster = local_cluster
    for path in _connection_files(cluster):
        info = json.loads(path.read_text())
        assert len(info["key"]) >= 32 and info["signature_scheme"] == "hmac-sha256"
    assert client.session.auth is not None and client.session.key
    view = client[:]
    view.execute(
        "_session = get_ipython().kernel.session; _signing = (_session.signature_scheme, bool(_session.key))",
        block=True,
    )
    assert view.pull("_signing", block=True) == [("hmac-sha256", True)] * 4


@pytest.mark.parametrize("profile", ["local", "slurm", "jupyterhub"])
def test_no_profile_touches_message_signing(profile: str) -> None:
    config = ddlab.runtime.cluster.profile_config(profile)
    for section in ("Session", "IPController", "IPEngine"):
        for name in ("key", "keyfile", "signature_scheme"):
            assert name not in config.get(section, {}), f"{profile} sets {section}.{name}"


def test_no_source_file_touches_message_signing() -> None:
    sources = [*LIBRARY.rglob("*.py"), *ddlab.runtime.cluster.CLUSTERS_DIR.rglob("*.py")]
    for path in sources:
        text = path.read_text()
        for word in ("Session.key", "signature_scheme", "Session.keyfile"):
            assert word not in text, f"{path} mentions {word}"


@pytest.mark.parametrize("profile", ["slurm", "jupyterhub"])
def test_cluster_profiles_listen_on_one_address(profile: str) -> None:
    config = ddlab.runtime.cluster.profile_config(profile)
    address = slurm.controller_address(slurm.load_settings())
    assert config.Cluster.controller_ip == address
    assert address not in ("", "*", "0.0.0.0")


def test_the_graders_kernel_channels_open_no_tcp_port(tmp_path: Path) -> None:
    """`ddlab grade` and bench/lab_time.py talk to their kernel over Unix sockets (kernel_config). The one TCP
    port left is ipykernel's own, on loopback: where forked children send their output (over TCP there are six)."""
    from ddlab.tools.grading.run import KERNEL, kernel_config
    from jupyter_client.manager import KernelManager

    manager = KernelManager(kernel_name=KERNEL, config=kernel_config(str(tmp_path)))
    manager.start_kernel()
    try:
        client = manager.client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        client.stop_channels()
        kernel = psutil.Process(manager.provisioner.pid)
        listening = [conn.laddr for conn in kernel.net_connections(kind="inet") if conn.status == psutil.CONN_LISTEN]
        assert len(listening) <= 1 and all(_is_loopback(address.ip) for address in listening), listening
        assert len(list(tmp_path.glob("kernel-*"))) == 5, "its five channels are sockets in the folder given"
    finally:
        manager.shutdown_kernel(now=True)
