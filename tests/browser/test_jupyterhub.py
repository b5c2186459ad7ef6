"""An instructor's hub, for real: JupyterHub with its proxy, batchspawner's SlurmSpawner behind
wrapspawner's ProfilesSpawner, on the private Slurm node of the test suite (tests/conftest.py).

The hub runs clusters/jupyterhub/jupyterhub_config_example.py, changing only ports and
addresses (loopback), paths (state, the course folder, the private Slurm's configuration)
and the authenticator (one user, one password). In Chromium a student logs in, picks the
4-engine profile, waits for the Slurm job, runs lab 02's solution with the `jupyterhub`
profile (engines as a step of the server's own job), follows the course site's launch link
for lab 00 (nbgitpuller pulls the course and JupyterLab opens the lab), and stops the server from the
hub's control panel; then no job, process or listening port may be left.

Set-up installs what is missing: clusters/jupyterhub/requirements-hub.txt with pip into
this environment (hub and course environment at once), configurable-http-proxy with npm
into a cache folder outside the repository, and sudo (batchspawner submits with
`sudo -u <user>`) with apt-get. The server runs as the user running the tests, which is
root in CI: the course environment's Python may not be usable by another user.
"""

from __future__ import annotations

import getpass
import importlib.util
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from browser_support import (
    ROOT,
    Missing,
    copy_notebooks,
    free_port,
    listening,
    pip_install,
    single_node,
    skip_or_fail,
    stop_process_tree,
    wait_for_http,
    write_lab_settings,
)
from notebook_page import NotebookPage, student_view_problems

EXAMPLE = ROOT / "clusters" / "jupyterhub" / "jupyterhub_config_example.py"
REQUIREMENTS = ROOT / "clusters" / "jupyterhub" / "requirements-hub.txt"
PROXY = "configurable-http-proxy@5.3.0"
NOTEBOOK = "solutions/02_collectives.ipynb"
PROFILE = "ddlab lab, 4 engines (5 cores)"


def npm_cache() -> Path:
    """Where npm installs the proxy: a cache folder outside the repository."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ddlab" / "npm"


def install_hub() -> Path:
    """JupyterHub, batchspawner, wrapspawner (pip), the proxy (npm), sudo (apt); the proxy's path."""
    if any(importlib.util.find_spec(n) is None for n in ("jupyterhub", "batchspawner", "wrapspawner", "nbgitpuller")):
        pip_install("-r", str(REQUIREMENTS))
    proxy = npm_cache() / "node_modules" / ".bin" / "configurable-http-proxy"
    if not proxy.exists():
        if shutil.which("npm") is None:
            raise Missing("configurable-http-proxy is not installed and there is no npm to install it")
        npm_cache().mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(npm_cache()), PROXY],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0 or not proxy.exists():
            raise Missing(f"`npm install {PROXY}` failed:\n{done.stderr[-2000:]}")
    try:
        single_node.apt_install(["sudo"], lambda: [] if shutil.which("sudo") else ["sudo"], "sudo", timeout=300)
    except single_node.CannotInstall as err:
        raise Missing(str(err)) from None
    return proxy


def hub_config(folder: Path, proxy: Path, ports: dict[str, int], user: str, password: str, slurm_conf: Path) -> str:
    """The example, then the test's ports, paths and authenticator."""
    venv_bin = Path(sys.executable).parent
    paths = {  # the single-user server's files: in the test's folder, not the user's home
        "SLURM_CONF": str(slurm_conf),
        "IPYTHONDIR": os.environ["IPYTHONDIR"],  # the test session's: its clean-up sees the engines
        "JUPYTER_CONFIG_DIR": str(folder / "user" / "config"),
        "JUPYTER_RUNTIME_DIR": str(folder / "user" / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(folder / "user" / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(folder / "user" / "workspaces"),
    }
    return f"""\
load_subconfig({str(EXAMPLE)!r})

# Ports and addresses: everything on loopback, on free ports.
c.JupyterHub.bind_url = "http://127.0.0.1:{ports["public"]}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {ports["hub"]}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{ports["proxy_api"]}"
# Paths: the hub's state, the proxy from npm, the course folder, the private Slurm.
c.JupyterHub.db_url = "sqlite:///{folder / "jupyterhub.sqlite"}"
c.JupyterHub.cookie_secret_file = {str(folder / "cookie_secret")!r}
c.JupyterHub.pid_file = {str(folder / "jupyterhub.pid")!r}
c.ConfigurableHTTPProxy.command = [{str(proxy)!r}]
c.ConfigurableHTTPProxy.pid_file = {str(folder / "proxy.pid")!r}
c.Spawner.notebook_dir = {str(folder / "course")!r}
for _profile in c.ProfilesSpawner.profiles:
    _settings = _profile[3]
    if "req_prologue" in _settings:
        _settings["req_prologue"] = "export PATH={venv_bin}:$PATH"
        _settings["req_homedir"] = {str(folder)!r}  # the job's folder and log, not the user's home
    _settings["environment"] = {{**_settings.get("environment", {{}}), **{paths!r}}}
# The authenticator: one user, one password.
c.JupyterHub.authenticator_class = "jupyterhub.authenticators.shared.SharedPasswordAuthenticator"
c.SharedPasswordAuthenticator.user_password = {password!r}
c.Authenticator.allowed_users = {{{user!r}}}
"""


@pytest.fixture(scope="module")
def hub(browser, slurm, tmp_path_factory: pytest.TempPathFactory):
    """A running JupyterHub on the session's Slurm node: (URL, user, password, node, folder)."""
    try:
        proxy = install_hub()
    except Missing as err:
        skip_or_fail("JupyterHub", err)
    folder = tmp_path_factory.mktemp("jupyterhub")
    folder.chmod(0o755)
    copy_notebooks([NOTEBOOK], folder / "course")
    write_lab_settings(folder / "user" / "settings")
    if os.geteuid() == 0:  # the user's own Jupyter configuration: the tests run as root (CI)
        (folder / "user" / "config").mkdir(parents=True)
        (folder / "user" / "config" / "jupyter_server_config.json").write_text('{"ServerApp": {"allow_root": true}}')
    ports = {name: free_port() for name in ("public", "hub", "proxy_api")}
    user, password = getpass.getuser(), secrets.token_hex(12)
    (folder / "jupyterhub_config.py").write_text(hub_config(folder, proxy, ports, user, password, slurm.conf))
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "DDLAB_PROGRESS")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    log = folder / "jupyterhub.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "jupyterhub"), "-f", "jupyterhub_config.py"],
            cwd=folder,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{ports['public']}"
    try:
        wait_for_http(f"{url}/hub/api", process, log, timeout=120, status=200)  # the hub, not its proxy
        yield url, user, password, slurm, folder
    finally:
        left = stop_process_tree(process)
        print(log.read_text(errors="replace")[-3000:])
    assert not left, f"processes outlived the hub: {left}"
    busy = [port for port in ports.values() if listening(port)]
    assert not busy, f"ports {busy} still listen after the hub stopped"


def spawner_jobs(node) -> list[dict[str, str]]:
    return [job for job in node.job_records() if job.get("JobName") == "spawner-jupyterhub"]


@pytest.mark.timeout(900)
def test_student_runs_lab_02_on_a_hub_spawning_into_slurm(page, hub, course_site) -> None:
    url, user, password, node, folder = hub
    known = {job["JobId"] for job in spawner_jobs(node)}

    login = page.goto(f"{url}/hub/login")
    assert login is not None and login.ok, f"the login page answered {login and login.status}: {page.content()[:2000]}"
    page.fill("#username_input", user)
    page.fill("#password_input", password)
    page.click("#login_submit")
    page.wait_for_url(re.compile(r"/hub/spawn"), timeout=60_000)
    page.select_option("select[name=profile]", label=PROFILE)
    page.locator("form input[type=submit], form button[type=submit]").first.click()
    page.wait_for_url(re.compile(rf"/user/{user}/lab"), timeout=240_000)

    [job] = [j for j in spawner_jobs(node) if j["JobId"] not in known]
    assert job["JobState"] == "RUNNING" and job["NumCPUs"] == "5", job

    notebook = page.notebook = NotebookPage(page, f"{url}/user/{user}/lab")
    notebook.open(NOTEBOOK)
    notebook.pick_kernel()
    notebook.run_all(timeout=400)
    cells = notebook.cells(ROOT / NOTEBOOK)
    problems = student_view_problems(cells, ROOT / NOTEBOOK, in_lab=False)
    assert not problems, f"{NOTEBOOK} on the hub:\n" + "\n".join(problems)
    assert "4 engines up (MPI ranks 0..3), profile 'jupyterhub'" in cells[2].text(), str(cells[2])

    follow_the_sites_launch_link(page, url, user, folder)

    page.goto(f"{url}/hub/home")
    page.click("#stop")
    page.locator("#stop").wait_for(state="hidden", timeout=120_000)  # the hub answered the stop
    deadline = time.monotonic() + 120
    while page.goto(f"{url}/hub/home") and page.locator("#stop").count() and time.monotonic() < deadline:
        time.sleep(1)  # the hub still counts the server as active (stop pending)
    assert not page.locator("#stop").count(), "the hub still lists the server as running"
    while node.jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not node.jobs(), f"Slurm jobs left after stopping the server: {node.jobs()}"
    record = next(j for j in node.job_records() if j["JobId"] == job["JobId"])
    assert record["JobState"] in ("CANCELLED", "COMPLETED"), record
    while (left := job_processes(job["JobId"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of job {job['JobId']} outlived it: {left}"
    [port] = re.findall(rf"job {job['JobId']} started at \S+:(\d+)", (folder / "jupyterhub.log").read_text())
    assert not listening(int(port)), f"the server's port {port} still listens"


LAUNCHED = "00_cluster"


def follow_the_sites_launch_link(page, url: str, user: str, folder: Path) -> None:
    """The course site's page of lab 00, built with this hub as the class's: its launch link pulls the
    course (a clone of this repository's HEAD) into the student's folder and opens the lab in JupyterLab."""
    from ddlab.tools.site import build, load_settings

    course = folder / "course.git"
    subprocess.run(["git", "init", "--quiet", "--bare", str(course)], check=True, timeout=60)
    subprocess.run(
        ["git", "-C", str(ROOT), "push", "--quiet", str(course), "HEAD:refs/heads/main"], check=True, timeout=120
    )
    settings = load_settings(hub=url, repository=str(course), branch="main")
    home = build(folder / "site", settings, only=[LAUNCHED])
    page.goto((home.parent / "labs" / f"{LAUNCHED}.html").as_uri())
    page.locator('a[href*="/hub/user-redirect/git-pull?"]').first.click()
    opened = f"{settings.folder}/labs/{LAUNCHED}.ipynb"
    page.wait_for_url(re.compile(rf"/user/{user}/lab/tree/{re.escape(opened)}"), timeout=180_000)
    page.locator(f'.lm-TabBar-tab[title*="{opened}"]').wait_for(state="visible", timeout=120_000)
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").first.wait_for(state="visible", timeout=120_000)
    pulled = folder / "course" / opened
    assert pulled.read_bytes() == (ROOT / "labs" / f"{LAUNCHED}.ipynb").read_bytes(), "the pulled lab is not HEAD's"


def job_processes(job_id: str) -> list[str]:
    """Command lines of the processes still running for a Slurm job."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SLURM_JOB_ID") == job_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(" ".join(proc.cmdline())[:150])
        except psutil.Error:
            continue
    return found


def test_config_example_is_what_the_hub_test_runs() -> None:
    """The test changes ports, paths and the authenticator only: every other setting is the example's."""
    text = hub_config(Path("/x"), Path("/p"), {"public": 1, "hub": 2, "proxy_api": 3}, "u", "pw", Path("/s"))
    overridden = set(re.findall(r"^(c\.\w+\.\w+)", text, re.MULTILINE))
    assert overridden <= {
        "c.JupyterHub.bind_url",
        "c.JupyterHub.hub_ip",
        "c.JupyterHub.hub_port",
        "c.ConfigurableHTTPProxy.api_url",
        "c.JupyterHub.db_url",
        "c.JupyterHub.cookie_secret_file",
        "c.JupyterHub.pid_file",
        "c.ConfigurableHTTPProxy.command",
        "c.ConfigurableHTTPProxy.pid_file",
        "c.Spawner.notebook_dir",
        "c.JupyterHub.authenticator_class",
        "c.SharedPasswordAuthenticator.user_password",
        "c.Authenticator.allowed_users",
    }, overridden
