"""Which MPI wheel should the course default to? Measure 4 engines on this machine.

For each venv given (default: .venv and .venv-mpich, made by `make setup` and
`make setup VENV=.venv-mpich MPI=mpich`), start 4 engines through ddlab.runtime.cluster
and time, on the engines: cluster start-up, 8 B and 16 MiB ping-pong between ranks
0 and 1, and a 1 MiB Allreduce. Rounds alternate between the venvs; the medians
and their ratios are printed.

    .venv/bin/python bench/mpi_choice.py [--rounds 3] [VENV ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs inside one venv: start engines, measure on them, print one JSON line.
PROBE = r"""
import json, time
import ddlab.runtime.cluster
t0 = time.perf_counter()
rc = ddlab.runtime.cluster.start(n=4)
startup = time.perf_counter() - t0
rc[:].execute('''
from mpi4py import MPI
import numpy as np, time
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
def pingpong(nbytes, reps):
    buf = np.zeros(nbytes, np.uint8)
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(reps):
        if rank == 0:
            comm.Send(buf, 1); comm.Recv(buf, 1)
        elif rank == 1:
            comm.Recv(buf, 0); comm.Send(buf, 0)
    return (time.perf_counter() - t) / reps / 2
def allreduce(nbytes, reps):
    x = np.ones(nbytes // 8); y = np.empty_like(x)
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(reps):
        comm.Allreduce(x, y)
    return (time.perf_counter() - t) / reps
pingpong(8, 100)
result = dict(latency=pingpong(8, 2000), pingpong_16MiB=pingpong(16 << 20, 20),
              allreduce_1MiB=allreduce(1 << 20, 50))
''', block=True)
result = rc[0].pull("result", block=True)
library = rc[0].apply_sync(lambda: __import__("mpi4py.MPI").MPI.Get_library_version().split()[0:3])
ddlab.runtime.cluster.stop()
print(json.dumps(dict(result, startup=startup, library=" ".join(library))))
"""


def measure(venv: Path) -> dict:
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", PROBE], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    if done.returncode != 0:
        sys.exit(f"{venv}: the probe failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("venvs", nargs="*", type=Path, default=[ROOT / ".venv", ROOT / ".venv-mpich"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    missing = [v for v in args.venvs if not (v / "bin" / "python").exists()]
    if missing:
        print(
            f"skipped: no venv at {', '.join(map(str, missing))} "
            "(make one with `make setup VENV=.venv-mpich MPI=mpich`)"
        )
        return
    runs: dict[Path, list[dict]] = {v: [] for v in args.venvs}
    for _ in range(args.rounds):
        for venv in args.venvs:  # alternate, so load on the machine hits both alike
            runs[venv].append(measure(venv))
    metrics = ["startup", "latency", "pingpong_16MiB", "allreduce_1MiB"]
    medians = {v: {m: statistics.median(r[m] for r in rs) for m in metrics} for v, rs in runs.items()}
    names = {v: runs[v][0]["library"] for v in args.venvs}
    print(f"4 engines on {__import__('os').cpu_count()} cores, median of {args.rounds} alternating rounds")
    print(f"{'metric':<16}" + "".join(f"{names[v]:>22}" for v in args.venvs) + "   ratio (first/others)")
    for m in metrics:
        row = [medians[v][m] for v in args.venvs]
        unit, scale = ("s", 1) if m == "startup" else ("us", 1e6)
        cells = "".join(f"{x * scale:>19.1f} {unit:<2}" for x in row)
        ratios = ", ".join(f"{row[0] / x:.2f}" for x in row[1:])
        print(f"{m:<16}{cells}   {ratios}")


if __name__ == "__main__":
    main()
