"""Hand-written allreduce against MPI_Allreduce, measured side by side on 2 and 4 ranks.

For each rank count, one MPI job times every algorithm of ddlab.allreduce and the MPI
library's Allreduce at 1 KiB, 64 KiB, 1 MiB, 16 MiB and 64 MiB of float32, taking
turns within every repeat, and prints each one's time divided by MPI_Allreduce's
(median and best of the repeats). The baseline returns a new array, as the
hand-written ones do; the table also shows MPI_Allreduce into a preallocated buffer,
and every rank copying its vector into a new array (`x.copy()`), a floor for anything
that returns a new array. Then the ring's bus bandwidth over this machine's memcpy
bandwidth (one process copying 64 MiB, nothing else running in the job).

    .venv/bin/python bench/allreduce.py [--ranks 2 4] [--repeats-scale 1.0]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import os
import sys

SIZES = [2**10, 2**16, 2**20, 2**24, 2**26]
TIMEOUT = 1800


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 2**20 else f"{nbytes >> 10} KiB"


def _repeats(nbytes: int, scale: float) -> int:
    """Many repeats for small sizes (noisy, cheap), few for large ones."""
    return max(5, int(min(300, 2**25 // nbytes) * scale))


def child(scale: float) -> None:
    """Inside the MPI job: measure, and print the tables on rank 0."""
    import numpy as np
    from ddlab.allreduce import ALGORITHMS, allreduce_mpi
    from ddlab.allreduce.cost import bus_bandwidth, measure_memcpy_bandwidth, time_allreduce
    from ddlab.p2p import idle_wait
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    memcpy = measure_memcpy_bandwidth() if rank == 0 else 0.0  # the others sleep meanwhile
    idle_wait(comm.Ibarrier())
    preallocated: dict[int, np.ndarray] = {}

    def mpi_preallocated(comm: MPI.Comm, x: np.ndarray) -> None:
        out = preallocated.setdefault(x.size, np.empty_like(x))
        comm.Allreduce(x, out, op=MPI.SUM)

    contenders = {
        "mpi": allreduce_mpi,
        **ALGORITHMS,
        "mpi_prealloc": mpi_preallocated,
        "x.copy()": lambda comm, x: x.copy(),
    }
    median, best = {}, {}
    for nbytes in SIZES:
        seconds = time_allreduce(comm, contenders, [nbytes], _repeats(nbytes, scale))
        median[nbytes] = {name: float(np.median(s)) for name, s in seconds.items()}
        best[nbytes] = {name: float(np.min(s)) for name, s in seconds.items()}
        preallocated.clear()
    if rank != 0:
        return
    names = [name for name in contenders if name != "mpi"]
    print(f"\n{size} ranks on {os.cpu_count()} cores, {MPI.Get_library_version().split(',')[0]}")
    for title, table in (("median", median), ("best", best)):
        print(f"time / MPI_Allreduce time ({title} of the repeats; MPI_Allreduce into a new array, in us)")
        print(f"{'size':>8} {'MPI us':>9}" + "".join(f"{n:>19}" for n in names))
        for nbytes in SIZES:
            row = table[nbytes]
            print(
                f"{_label(nbytes):>8} {row['mpi'] * 1e6:>9.1f}"
                + "".join(f"{row[n] / row['mpi']:>19.2f}" for n in names)
            )
    print(f"memcpy bandwidth (one process alone): {memcpy / 1e9:.2f} GB/s")
    for nbytes in SIZES[-2:]:
        row = median[nbytes]
        ring, mpi = bus_bandwidth(nbytes, row["ring"], size), bus_bandwidth(nbytes, row["mpi_prealloc"], size)
        print(
            f"{_label(nbytes):>8}: ring bus bandwidth {ring / 1e9:.2f} GB/s = {ring / memcpy:.0%} of memcpy "
            f"(MPI_Allreduce, preallocated: {mpi / memcpy:.0%}); ring / MPI_Allreduce preallocated "
            f"{row['ring'] / row['mpi_prealloc']:.2f}; ring / x.copy() on every rank "
            f"{row['ring'] / row['x.copy()']:.2f}"
        )
    sys.stdout.flush()


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats-scale", type=float, default=1.0, help="multiply every repeat count")
    return bench_main(parser, lambda a: child(a.repeats_scale), TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
