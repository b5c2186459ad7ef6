"""What the browser tests need besides the page: installing Chromium and Playwright, servers.

Set-up installs what is missing: Chromium with apt-get (as root; no browser download),
Playwright's Python package with pip into this environment (see conftest.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
ARTEFACTS = ROOT / "out" / "browser"
IN_CI = os.environ.get("CI", "").lower() == "true"
CHROMIUM = "/usr/bin/chromium"
#: What the set-up installs (docs/testing.md lists the same).
CHROMIUM_PACKAGES = ["chromium"]
PLAYWRIGHT = "playwright==1.65.2"
single_node = sys.modules["single_node"]  # loaded by tests/conftest.py


class Missing(RuntimeError):
    """Something these tests need is absent and could not be installed."""


def skip_or_fail(what: str, err: Exception) -> None:
    """Skip saying what is missing, or fail under CI=true."""
    if IN_CI:
        pytest.fail(f"CI=true, so the {what} tests must run, but: {err}")
    pytest.skip(
        f"{what} tests skipped: {err}. Their set-up installs it as root with apt-get, pip and npm; "
        "they always run in CI."
    )


def pip_install(*requirements: str, timeout: float = 600) -> None:
    """pip install into this environment; raise Missing with pip's words when it fails."""
    command = [sys.executable, "-m", "pip", "install", "--quiet", *requirements]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Missing(f"`pip install {' '.join(requirements)}` took longer than {timeout:.0f} s") from None
    if done.returncode != 0:
        raise Missing(f"`pip install {' '.join(requirements)}` failed:\n{done.stderr[-2000:]}")


def install_browser() -> None:
    """Chromium (apt-get) and Playwright (pip), unless present."""
    try:
        single_node.apt_install(
            CHROMIUM_PACKAGES, lambda: [] if os.path.exists(CHROMIUM) else [CHROMIUM], "Chromium", timeout=600
        )
    except single_node.CannotInstall as err:
        raise Missing(str(err)) from None
    if importlib.util.find_spec("playwright") is None:
        pip_install(PLAYWRIGHT)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_http(url: str, process: subprocess.Popen, log: Path, timeout: float, status: int | None = None) -> None:
    """Wait until `url` answers, with `status` if given (else any: a server without a token says 403).

    Fail with the log if the process exits or time runs out. Behind a proxy, ask for the
    server's own status: the proxy may answer (404, 503) before the server listens.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if status in (None, answer.status):
                    return
        except urllib.error.HTTPError as err:
            if status in (None, err.code):
                return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"{url} did not answer ({'exited' if process.poll() is not None else 'timed out'}):\n"
                f"{log.read_text(errors='replace')[-4000:]}"
            )
        time.sleep(0.3)


def stop_process_tree(process: subprocess.Popen, timeout: float = 30) -> list[str]:
    """SIGTERM a server, wait for it and its children; kill what is left and return their command lines."""
    with contextlib.suppress(psutil.Error):
        children = psutil.Process(process.pid).children(recursive=True)
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
    _, alive = psutil.wait_procs(children, timeout=10)
    left = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            left.append(" ".join(proc.cmdline())[:200])
            proc.kill()
    return left


def listening(port: int) -> bool:
    """True if something on this machine still listens on `port`."""
    return any(
        c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.net_connections("tcp")
    )


def copy_notebooks(paths: list[str], folder: Path) -> None:
    """Copy course notebooks (paths relative to the repository) under `folder`, same layout."""
    for path in paths:
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, folder / path)


def write_lab_settings(settings_dir: Path) -> None:
    """JupyterLab user settings: render every cell (not only those in view), never autosave."""
    for plugin, values in {
        "notebook-extension/tracker": '{"windowingMode": "none"}',
        "docmanager-extension/plugin": '{"autosave": false}',
        "apputils-extension/notification": '{"fetchNews": "false", "checkForUpdates": false}',
    }.items():
        path = settings_dir / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(values)
