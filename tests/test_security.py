"""What keeps other users out: the local controller listens on loopback only, connection
files are for their owner's eyes only, and every message stays signed.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import ddlab.runtime.cluster
import psutil
import pytest
from ddlab.tools import slurm

LIBRARY = Path(ddlab.runtime.cluster.__file__).parent


@pytest.fixture(scope="module")
def local_cluster():
    """One engine on the local profile, with the files its controller wrote."""
    with ddlab.runtime.cluster.running(1, "local") as client:
        yield client, ddlab.runtime.cluster._current.cluster


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
    assert view.pull("_signing", block=True) == [("hmac-sha256", True)]


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
