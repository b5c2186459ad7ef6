"""A sharded checkpoint whose rewrite a rank did not survive is refused, on any rank count, never loaded half.

A real MPI job (3 ranks under mpiexec) saves a whole checkpoint, takes a step and
rewrites it; rank 1 writes half of its shard's bytes to disk and SIGKILLs itself,
so mpiexec ends the job. Then another job (2 ranks) and this process (1 rank) load
the directory: both refuse it, and the model they loaded into keeps its own values.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddlab import sharded
from ddlab.models import make_mlp
from ddlab.runtime.mpi import run_ranks
from mpi4py import MPI

TIMEOUT = 240  # seconds per job, under load; a job that hangs after the kill is itself a failure

JOB = """
import io, os, signal, sys
import torch
from mpi4py import MPI
from ddlab import sharded
from ddlab.models import make_mlp

comm, path, mode = MPI.COMM_WORLD, sys.argv[1], sys.argv[2]
rank = comm.Get_rank()
model = sharded.Sharded(make_mlp(seed=1, dtype=torch.float64, hidden=(7, 5)), comm, stage=3)
optimizer = model.attach(torch.optim.Adam(model.shards(), lr=1e-2))
if mode == "load":
    before = [s.detach().clone() for s in model.shards()]
    try:
        sharded.load_sharded(path, model, optimizer)
        print(f"rank {rank}: LOADED", flush=True)
    except sharded.CheckpointError as err:
        kept = all(torch.equal(a, b) for a, b in zip(before, model.shards())) and not optimizer.state
        print(f"rank {rank}: REFUSED kept={kept}: {err}", flush=True)
    model.close()
    sys.exit(0)


def step():
    optimizer.zero_grad()
    x = torch.linspace(-1, 1, 600 * 4, dtype=torch.float64).reshape(4, 600) * (rank + 1)
    model(x).square().mean().backward()
    optimizer.step()


step()
sharded.save_sharded(path, model, optimizer, step=1)
if rank == 0:
    print("COMMITTED ONCE", flush=True)
step()
if rank == 1:
    whole_save = torch.save

    def half_then_die(obj, handle):
        data = io.BytesIO()
        whole_save(obj, data)
        handle.write(data.getvalue()[: len(data.getvalue()) // 2])
        handle.flush()
        os.fsync(handle.fileno())
        print("rank 1: KILLED MID-WRITE", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = half_then_die
sharded.save_sharded(path, model, optimizer, step=2)
print(f"rank {rank}: REWRITE DONE", flush=True)
"""


def run_job(ranks: int, script: Path, *args: str) -> str:
    try:
        done = run_ranks(ranks, [sys.executable, str(script), *args], timeout=TIMEOUT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the {ranks}-rank job did not end in {TIMEOUT} s:\n{err.output}")
    return done.stdout


def test_a_checkpoint_a_rank_was_killed_writing_is_refused_on_any_rank_count(tmp_path: Path) -> None:
    script, path = tmp_path / "job.py", tmp_path / "checkpoint"
    script.write_text(JOB)
    out = run_job(3, script, str(path), "write")
    assert "COMMITTED ONCE" in out and "rank 1: KILLED MID-WRITE" in out, out[-5000:]
    assert "REWRITE DONE" not in out, out[-5000:]
    # what the killed run left: a half file of rank 1, the others' new shards, the old index, no marker
    assert (path / "shard-00001.pt.partial").exists() and not (path / "shard-00001.pt").exists()
    assert (path / "index.json").exists() and not (path / sharded.checkpoint.COMMITTED).exists()

    out = run_job(2, script, str(path), "load")
    for rank in (0, 1):
        assert f"rank {rank}: REFUSED kept=True: " in out and "COMMITTED marker" in out, out[-5000:]
    assert "LOADED" not in out, out[-5000:]

    model = sharded.Sharded(make_mlp(seed=1, dtype=torch.float64, hidden=(7, 5)), MPI.COMM_SELF, stage=3)
    optimizer = model.attach(torch.optim.Adam(model.shards(), lr=1e-2))
    before = [s.detach().clone() for s in model.shards()]
    with pytest.raises(sharded.CheckpointError, match="no COMMITTED marker.*stopped before every rank"):
        sharded.load_sharded(path, model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, model.shards())) and not optimizer.state
    model.close()
