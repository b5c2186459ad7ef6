"""Shared memory only (what ddlab gives ranks on one host) beside the transports ranks had before, in one run.

Ranks on one host need no network transport; until issue 55 Open MPI kept its TCP transport
(`OMPI_MCA_btl=^ofi`), which opens a port on every interface of every rank. This measures both
settings on 4 ranks, the jobs taking turns (`--rounds`, default 3, each setting once per round),
so load from elsewhere on the machine hits both alike:

- lab 01's ping-pong between ranks 0 and 1 (`ddlab.p2p.sweep`, the fastest of 3 timings per size);
- what `bench/allreduce.py --part sizes` times: MPI_Allreduce and ddlab's ring at 1 KiB to 64 MiB
  of float32 (`ddlab.allreduce.cost.time_allreduce`, the median of the repeats).

Per size it prints each setting's median over the rounds, before / now, and the noise: the
larger of the two settings' spreads over the rounds (slowest / fastest - 1). A size where "now"
is slower by more than the noise is marked SLOWER.

    .venv/bin/python bench/transport.py [--rounds 3] [--largest 64] [--part ping-pong allreduce]

(`--largest`: the largest message and vector, in MiB.)

Open MPI: shared memory is `OMPI_MCA_btl=self,sm`, before is `^ofi`. MPICH: shared memory is
`UCX_TLS=^tcp` (and libfabric's shm provider), before is UCX's default (every transport).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

RANKS = 4
TIMEOUT = 900
PING_SIZES = [2**k for k in range(3, 25, 3)]  # 8 B to 16 MiB
ALLREDUCE_SIZES = [2**10, 2**16, 2**20, 2**24, 2**26]
PARTS = ["ping-pong", "allreduce"]
#: Per MPI: the variable that chooses the transports, and its value before issue 55 (None: unset).
BEFORE = {"openmpi": ("OMPI_MCA_btl", "^ofi"), "mpich": ("UCX_TLS", None)}


def _label(nbytes: int) -> str:
    if nbytes >= 2**20:
        return f"{nbytes >> 20} MiB"
    return f"{nbytes >> 10} KiB" if nbytes >= 2**10 else f"{nbytes} B"


def child(largest: int, parts: list[str]) -> None:
    """Inside the MPI job: measure the parts, rank 0 prints one JSON line."""
    import numpy as np
    from ddlab.allreduce import allreduce_mpi, allreduce_ring
    from ddlab.allreduce.cost import time_allreduce
    from ddlab.p2p import sweep
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    sizes = [n for n in ALLREDUCE_SIZES if n <= largest] if "allreduce" in parts else []
    ping = sweep(comm, [n for n in PING_SIZES if n <= largest]) if "ping-pong" in parts else np.zeros(0)
    repeats = {n: max(5, min(100, 2**25 // n)) for n in sizes}
    allreduce: dict[str, list[float]] = {"MPI_Allreduce": [], "ring": []}
    for nbytes in sizes:
        seconds = time_allreduce(
            comm, {"MPI_Allreduce": allreduce_mpi, "ring": allreduce_ring}, [nbytes], repeats[nbytes]
        )
        for name, values in seconds.items():
            allreduce[name].append(float(np.median(values)))
    if comm.Get_rank() == 0:
        library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0].strip()
        print("RESULT " + json.dumps({"library": library, "ping-pong": ping.tolist(), **allreduce}), flush=True)


def _run_job(largest: int, parts: list[str], setting: str | None, name: str) -> dict[str, list[float]]:
    """One 4-rank job with the transport variable set to `setting` (None: unset)."""
    from ddlab.runtime import mpi

    saved = os.environ.pop(name, None)
    if setting is not None:
        os.environ[name] = setting
    try:
        command = [sys.executable, os.path.abspath(__file__), "--child", "--largest", str(largest >> 20)]
        command += ["--part", *parts]
        done = mpi.run_ranks(RANKS, command, timeout=TIMEOUT)
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the {name}={setting} job failed:\n{done.stdout}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _table(title: str, sizes: list[int], now: list[list[float]], before: list[list[float]]) -> None:
    import numpy as np

    now_a, before_a = np.array(now), np.array(before)  # (rounds, sizes)
    print(f"\n{title} (us; median of the rounds)")
    print(f"{'size':>8} {'shared memory':>14} {'before':>10} {'before/now':>11} {'noise':>7}")
    for i, nbytes in enumerate(sizes):
        a, b = float(np.median(now_a[:, i])), float(np.median(before_a[:, i]))
        noise = max(float(x[:, i].max() / x[:, i].min()) - 1 for x in (now_a, before_a))
        flag = "  SLOWER" if a > b * (1 + noise) else ""
        print(f"{_label(nbytes):>8} {a * 1e6:>14.1f} {b * 1e6:>10.1f} {b / a:>11.2f} {noise:>7.0%}{flag}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="jobs per setting, taking turns")
    parser.add_argument("--largest", type=int, default=64, help="largest message and vector, in MiB")
    parser.add_argument("--part", nargs="+", choices=PARTS, default=PARTS, help="what to measure")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    largest = args.largest << 20
    if args.child:
        child(largest, args.part)
        return 0
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: the noise is the spread between rounds")
    from ddlab.runtime import mpi

    impl = mpi.implementation()
    name, previous = BEFORE[impl]
    ours = mpi.rank_env(RANKS)[name] if name not in os.environ else None
    if ours is None:
        parser.error(f"{name} is set in this shell ({os.environ[name]}): unset it to compare ddlab's setting")
    runs: dict[str, list[dict[str, Any]]] = {"now": [], "before": []}
    for _ in range(args.rounds):
        runs["now"].append(_run_job(largest, args.part, ours, name))
        runs["before"].append(_run_job(largest, args.part, previous, name))
    print(f"{RANKS} ranks on {os.cpu_count()} cores, {runs['now'][0]['library']}")
    print(f"now: {name}={ours}; before: {name}={previous or '(unset)'}; {args.rounds} rounds, taking turns")
    ping = [n for n in PING_SIZES if n <= largest]
    reduce_sizes = [n for n in ALLREDUCE_SIZES if n <= largest]
    if "ping-pong" in args.part:
        _table("ping-pong, one way", ping, *[[r["ping-pong"] for r in runs[k]] for k in ("now", "before")])
    for what in ("MPI_Allreduce", "ring") if "allreduce" in args.part else ():
        _table(f"{what}, 4 ranks", reduce_sizes, *[[r[what] for r in runs[k]] for k in ("now", "before")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
