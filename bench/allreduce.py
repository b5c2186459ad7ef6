"""Hand-written allreduce against MPI_Allreduce, measured side by side on 2 and 4 ranks.

Three parts, all by default (`--part`):

- `sizes`: one MPI job times every algorithm of ddlab.allreduce and the MPI library's
  Allreduce at 1 KiB, 64 KiB, 1 MiB, 16 MiB and 64 MiB of float32, taking turns within
  every repeat, and prints each one's time divided by MPI_Allreduce's (median and best of
  the repeats). The baseline returns a new array, as the hand-written ones do; the table
  also shows MPI_Allreduce into a preallocated buffer, and every rank copying its vector
  into a new array (`x.copy()`), a floor for anything that returns a new array. Then the
  ring's bus bandwidth over this machine's memcpy bandwidth (one process copying 64 MiB,
  nothing else running in the job).
- `breakdown`: where a small call's time goes, at 800 B (100 int64) and 1 KiB (256 float32):
  the messages alone (a bare mpi4py Sendrecv loop of recursive doubling's pattern, the
  floor), the adds, the allocations, the agreement on length and dtype as a collective of
  its own, the deadline watch (the same messages waited for through a Watch, as a check's
  communicator waits), the counting communicator (the reference run on a CountingComm, as
  a check runs it), and the reference recursive doubling, whose agreement rides in its
  messages. Every part takes turns with MPI_Allreduce in every repeat.
- `peer`: the measurement of UCSD CSE 234's programming assignment 2 (its myAllreduce
  benchmark), as that course describes it, for one algorithm at a time as the course times
  its one myAllreduce: 100 runs; in each, every rank draws 100 random int64, then
  MPI_Allreduce and the algorithm are each timed between a barrier before the call and one
  after it (the closing barrier inside the timing), MPI's into a buffer made before the run.
  The score is the algorithm's average time over the runs divided by MPI_Allreduce's average
  in the same runs, printed beside the course's two tiers (1.5x and 1.05x). The course's
  protocol is 4 ranks; rank 0 reports its own clock, as there. (The course's script reduces
  with MPI.MIN; ddlab's allreduces sum, so both sides here sum.) The same protocol then times
  the breakdown's floors: recursive doubling's messages alone, and with its adds.

    .venv/bin/python bench/allreduce.py [--ranks 2 4] [--repeats-scale 1.0] [--part sizes breakdown peer]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

SIZES = [2**10, 2**16, 2**20, 2**24, 2**26]
TIMEOUT = 1800
#: The peer course's tiers: at most this many times MPI_Allreduce's average.
TIERS = (1.5, 1.05)
PEER_RUNS, PEER_ITEMS = 100, 100
#: Timed by the peer protocol after the algorithms: the floor of any allreduce written with mpi4py's
#: point-to-point calls (recursive doubling's messages into buffers made once, then with its adds).
FLOORS = ["messages (bare Sendrecv loop)", "messages + adds"]
#: The small sizes of the breakdown: (label, items, dtype).
SMALL = [("800 B", 100, "int64"), ("1 KiB", 256, "float32")]


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 2**20 else f"{nbytes >> 10} KiB"


def _repeats(nbytes: int, scale: float) -> int:
    """Many repeats for small sizes (noisy, cheap), few for large ones."""
    return max(5, int(min(300, 2**25 // nbytes) * scale))


def sizes(comm: Any, scale: float) -> None:
    """Every algorithm at every size, over MPI_Allreduce's time; rank 0 prints."""
    import numpy as np
    from ddlab.allreduce import ALGORITHMS, allreduce_mpi
    from ddlab.allreduce.cost import bus_bandwidth, measure_memcpy_bandwidth, time_allreduce
    from ddlab.p2p import idle_wait
    from mpi4py import MPI

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


def breakdown(comm: Any, scale: float) -> None:
    """Where a small call's time goes, part by part, against MPI_Allreduce; rank 0 prints."""
    import numpy as np
    from ddlab.allreduce.algorithms import doubling_steps
    from ddlab.allreduce.cost import time_allreduce
    from ddlab.allreduce.latency import MPI_PART, call_parts
    from ddlab.runtime.counting import CountingComm

    counting = CountingComm(comm, timeout=60.0)
    parts = call_parts(comm, counting)
    repeats = max(20, int(300 * scale))
    table = {}
    for label, n, dtype in SMALL:
        seconds = time_allreduce(comm, parts, [n * np.dtype(dtype).itemsize], repeats, dtype)
        table[label] = {name: float(np.median(s)) for name, s in seconds.items()}
    counting.free()
    if comm.Get_rank() != 0:
        return
    print(
        f"where a small call's time goes: recursive doubling's {len(doubling_steps(0, comm.Get_size()))} "
        f"messages on rank 0, median of {repeats} repeats, the parts taking turns"
    )
    print(f"{'part':>36}" + "".join(f"{label + ' us':>12}{'/ MPI':>7}" for label, _, _ in SMALL))
    for name in parts:
        print(
            f"{name:>36}"
            + "".join(f"{row[name] * 1e6:>12.1f}{row[name] / row[MPI_PART]:>7.2f}" for row in table.values())
        )
    for label, row in table.items():
        bare, watched = row["messages (bare Sendrecv loop)"], row["messages through the deadline watch"]
        print(
            f"{label}: reference recursive doubling / MPI_Allreduce {row['reference recursive doubling'] / row[MPI_PART]:.2f}; "
            f"a separate agreement would add {row['agreement as its own collective'] / row[MPI_PART]:.2f} x MPI's time; "
            f"the watch adds {(watched - bare) * 1e6:.1f} us to the messages"
        )


def peer(comm: Any) -> None:
    """UCSD CSE 234 PA2's measurement, one algorithm at a time as that course runs its one myAllreduce:
    100 runs, each timing MPI_Allreduce then the algorithm, a barrier before and after each call."""
    import numpy as np
    from ddlab.allreduce import ALGORITHMS
    from ddlab.allreduce.latency import call_parts
    from ddlab.runtime.counting import CountingComm
    from mpi4py import MPI

    rank = comm.Get_rank()
    counting = CountingComm(comm, timeout=60.0)
    parts = call_parts(comm, counting)
    floors = {name: parts[name] for name in FLOORS}  # the messages alone, as any hand-written version sends them
    counting.free()
    contenders = {**ALGORITHMS, **floors}
    mine, theirs = dict.fromkeys(contenders, 0.0), dict.fromkeys(contenders, 0.0)
    wrong: set[str] = set()
    for name, fn in contenders.items():
        for _ in range(PEER_RUNS):
            x = np.random.randint(0, 100, PEER_ITEMS).astype(np.int64)
            want = np.empty_like(x)
            comm.Barrier()
            start = MPI.Wtime()
            comm.Allreduce(x, want, op=MPI.SUM)
            comm.Barrier()
            theirs[name] += MPI.Wtime() - start
            comm.Barrier()
            start = MPI.Wtime()
            got = fn(comm, x)
            comm.Barrier()
            mine[name] += MPI.Wtime() - start
            if name in ALGORITHMS and not np.array_equal(got, want):
                wrong.add(name)
    wrong_anywhere = set().union(*comm.allgather(wrong))
    if rank != 0:
        return
    print(
        f"UCSD CSE 234 PA2's protocol: per algorithm, {PEER_RUNS} runs of {PEER_ITEMS} int64 on {comm.Get_size()} "
        "ranks, MPI_Allreduce then the algorithm, a barrier before and after each call (rank 0's clock)"
    )
    print(f"{'algorithm':>30} {'average us':>11} {'MPI us':>8} {'/ MPI':>7} {'<= 1.5x':>8} {'<= 1.05x':>9}")
    for name in contenders:
        ratio = mine[name] / theirs[name]
        marks = "".join(f"{'yes' if ratio <= tier else 'no':>{w}}" for tier, w in zip(TIERS, (9, 10)))
        print(
            f"{name:>30} {mine[name] / PEER_RUNS * 1e6:>11.1f} {theirs[name] / PEER_RUNS * 1e6:>8.1f} {ratio:>7.2f}{marks}"
            + ("  WRONG RESULT" if name in wrong_anywhere else "")
        )


def child(parts: list[str], scale: float) -> None:
    """Inside the MPI job: measure, and print on rank 0."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        print(f"\n{comm.Get_size()} ranks on {os.cpu_count()} cores, {MPI.Get_library_version().split(',')[0]}")
    if "sizes" in parts:
        sizes(comm, scale)
    if "breakdown" in parts:
        breakdown(comm, scale)
    if "peer" in parts:
        peer(comm)
    sys.stdout.flush()


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats-scale", type=float, default=1.0, help="multiply every repeat count")
    parser.add_argument(
        "--part", nargs="+", choices=["sizes", "breakdown", "peer"], default=["sizes", "breakdown", "peer"]
    )
    return bench_main(parser, lambda a: child(a.part, a.repeats_scale), TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
