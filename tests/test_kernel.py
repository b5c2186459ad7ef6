"""ddlab.runtime.cluster in a real kernel, as a student uses it: every rank's output shows, a
%%px cell stuck in MPI is interrupted and the engines restarted with the notebook's
variables intact, and a crashed engine is reported with the way out."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel


def run(client, code: str, timeout: float = 180) -> tuple[str, str]:
    """Execute code; return (status, everything printed or raised)."""
    msg_id = client.execute(code)
    text = []
    while True:
        msg = client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            text.append(content["text"])
        elif kind == "error":
            text.append(f"{content['ename']}: {content['evalue']}")
        elif kind in ("execute_result", "display_data"):
            text.append(content["data"].get("text/plain", ""))
        elif kind == "status" and content["execution_state"] == "idle":
            break
    while (reply := client.get_shell_msg(timeout=timeout))["parent_header"].get("msg_id") != msg_id:
        pass
    return reply["content"]["status"], "".join(text)


@pytest.fixture
def kernel():
    manager, client = start_new_kernel(kernel_name="ddlab")
    try:
        yield manager, client
    finally:
        run(client, "import ddlab.runtime.cluster; ddlab.runtime.cluster.stop()")
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_interrupt_a_hung_cell_then_restart_the_engines(kernel):
    manager, client = kernel
    status, out = run(
        client,
        "import ddlab.runtime.cluster\nrc = ddlab.runtime.cluster.start(n=2)\nnotebook_value = 42",
    )
    assert status == "ok", out
    msg_id = client.execute(
        "%%px\nfrom mpi4py import MPI\nimport numpy as np\nMPI.COMM_WORLD.Recv(np.empty(1), source=MPI.ANY_SOURCE)"
    )
    time.sleep(5)
    manager.interrupt_kernel()
    deadline = time.monotonic() + 60
    while True:  # the stuck cell ends (with an error) once interrupted
        msg = client.get_iopub_msg(timeout=60)
        if (
            msg["parent_header"].get("msg_id") == msg_id
            and msg["msg_type"] == "status"
            and msg["content"]["execution_state"] == "idle"
        ):
            break
        assert time.monotonic() < deadline, "the interrupted cell never finished"
    client.get_shell_msg(timeout=60)

    status, out = run(
        client,
        "rc = ddlab.runtime.cluster.restart()\nprint(ddlab.runtime.cluster.status(), notebook_value)",
    )
    assert status == "ok", out
    assert "2 engines up" in out and "42" in out, out
    status, out = run(
        client,
        "%px from mpi4py import MPI; r = MPI.COMM_WORLD.Get_rank()\nprint(rc[:].pull('r', block=True))",
    )
    assert status == "ok" and "[0, 1]" in out, out


def test_a_crashed_engine_is_reported_with_the_way_out(kernel):
    _, client = kernel
    status, out = run(client, "import ddlab.runtime.cluster\nrc = ddlab.runtime.cluster.start(n=2)")
    assert status == "ok", out
    status, out = run(client, "%%px --targets 1\nimport os\nos._exit(1)")
    assert "EngineError" in out, out
    deadline = time.monotonic() + 60
    while "ddlab.runtime.cluster.restart()" not in out:  # reported after a cell, once MPI ended the job
        assert time.monotonic() < deadline, f"no report of the crash: {out}"
        status, out = run(client, "import time; time.sleep(1)")
    assert "engines are up" in out
    status, out = run(
        client,
        "rc = ddlab.runtime.cluster.restart()\nprint(ddlab.runtime.cluster.status())",
    )
    assert status == "ok" and "2 engines up" in out, out


def test_every_rank_output_shows_and_no_progress_bar(kernel):
    _, client = kernel
    status, out = run(client, "import ddlab.runtime.cluster\nrc = ddlab.runtime.cluster.start(n=4)")
    assert status == "ok", out
    for attempt in range(3):
        status, out = run(
            client,
            "%%px\nimport time\nfrom mpi4py import MPI\ntime.sleep(0.5)\n"
            "print('hello from rank', MPI.COMM_WORLD.Get_rank())",
        )
        assert status == "ok", out
        lines = sorted(line.split("] ", 1)[-1] for line in out.splitlines() if "hello" in line)
        assert lines == [f"hello from rank {r}" for r in range(4)], (attempt, out)
        assert "%" not in out and "tasks" not in out, f"progress bar in the output: {out}"


#: Seconds within which the engines of a killed or restarted kernel are gone (README, "If a kernel dies").
GONE_WITHIN = 10
#: Kernels killed in a row: 3 in `make test` (whose 34 notebook runs each end in such a kill too); more to
#: stress the reaper, e.g. DDLAB_KILLS=50 (CONTRIBUTING.md).
KILLS = int(os.environ.get("DDLAB_KILLS", "3"))


def _kill_like_nbval(manager, client) -> None:
    """What nbval's teardown does: stop the channels and SIGKILL the kernel, no shutdown request."""
    client.stop_channels()
    manager.shutdown_kernel(now=True)


def _restart_like_jupyterlab(manager, client) -> None:
    """JupyterLab's restart: a shutdown request, then the same kernel started again."""
    client.stop_channels()
    manager.restart_kernel(now=False)
    manager.shutdown_kernel(now=True)


@pytest.mark.timeout((KILLS + 2) * 60)
def test_a_killed_kernel_leaves_no_engines(cluster_processes):
    """Kernels killed as nbval kills them (and restarted as JupyterLab does), many times in a row:
    each time, every process of its cluster and its record are gone within GONE_WITHIN seconds,
    so the next start of the profile finds nothing to clean up."""
    from ddlab.runtime import cluster
    from IPython.paths import get_ipython_dir

    def records() -> list[str]:
        return [p.name for p in (Path(get_ipython_dir()) / "profile_ddlab-local" / "security").glob("cluster-*.json")]

    for attempt in range(KILLS + 2):
        manager, client = start_new_kernel(kernel_name="ddlab")
        status, text = run(
            client,
            "from ddlab.runtime import cluster; cluster.start(n=2); print(cluster.status())",
        )
        assert status == "ok" and "2 engines up" in text, text
        started = cluster_processes()
        assert started, "the kernel's cluster should show as processes of this test run"
        (_restart_like_jupyterlab if attempt >= KILLS else _kill_like_nbval)(manager, client)
        killed = time.monotonic()
        while ((left := cluster_processes()) or records()) and time.monotonic() - killed < GONE_WITHIN:
            time.sleep(0.1)
        assert not left, (
            f"attempt {attempt + 1}: {len(left)} of the kernel's {len(started)} cluster processes still run "
            f"{GONE_WITHIN} s after the kernel died:\n" + "\n".join(f"  {' '.join(p.cmdline())[:120]}" for p in left)
        )
        assert not records(), f"attempt {attempt + 1}: the cluster's record outlived it by {GONE_WITHIN} s: {records()}"
        assert cluster.cleanup_orphans("local") == [], f"attempt {attempt + 1}: the next start had a cluster to clean"
