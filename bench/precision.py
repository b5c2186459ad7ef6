"""Low precision across ranks (ddlab.precision, lab 18): the float8 all-gather and a reduction's error against P.

On each rank count (--ranks, default 2 4 8; more ranks than cores run oversubscribed):

1. The all-gather of a ZeRO-3 unit of --items parameters (float32 shards), three ways, with MPI's
   Allgatherv (`ddlab.sharded.allgather_mpi`): float32, bfloat16 (its bits as int16) and float8 E4M3
   with each rank's scale (`ddlab.precision.float8_allgather`). Bytes sent by all ranks, counted through
   `ddlab.runtime.counting.CountingComm` with lab 03's ring (each chunk to the P - 1 others), and the
   time per gather (median over --rounds, the slowest rank's, the three taking turns), as ratios over
   bfloat16's. float8's bytes are half of bfloat16's plus 4 (P - 1) per rank for the scales.
2. The error of a ring reduce-scatter rounded at every hop (`ddlab.precision.reduce_scatter_rounded`) to
   bfloat16 and to float32, for inputs of one sign (uniform in [0.5, 1.5]: nothing cancels) and of both
   (normal): the largest |computed - exact| / sum_i |x_i| over every element, beside Higham's bound
   gamma_P = P u / (1 - P u) (Higham 2002, section 4.2).

    .venv/bin/python bench/precision.py [--ranks 2 4 8] [--items 1000000] [--rounds 7] [--chunk 65536]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

TIMEOUT = 1800


def child(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from ddlab import precision
    from ddlab.allreduce import allgather_ring
    from ddlab.runtime.counting import CountingComm, gather_traffic
    from ddlab.sharded import allgather_mpi
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    shard = args.items // size
    bounds = [r * shard for r in range(size + 1)]
    mine = (np.random.default_rng(rank).standard_normal(shard) * (rank + 1)).astype(np.float32)
    gathers = {
        "float32": lambda c, gather: gather(c, mine, bounds),
        "bfloat16": lambda c, gather: precision.bfloat16_allgather(c, mine, bounds, gather),
        "float8": lambda c, gather: precision.float8_allgather(c, mine, bounds, torch.float8_e4m3fn, gather),
    }
    sent = {}
    for name, run in gathers.items():
        counting = CountingComm(comm, timeout=600.0)
        run(counting, allgather_ring)
        traffic = gather_traffic(counting)
        counting.free()
        sent[name] = sum(t.bytes_sent for t in traffic)
    times: dict[str, list[float]] = {name: [] for name in gathers}
    names = list(gathers)
    for round_ in range(args.rounds + 1):
        for name in names[round_ % 3 :] + names[: round_ % 3]:
            comm.Barrier()
            start = time.perf_counter()
            gathers[name](comm, allgather_mpi)
            took = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if round_:  # the first round warms up
                times[name].append(took)
    if rank == 0:
        print(f"P = {size}: all-gather of {bounds[-1]} parameters ({shard} per rank)")
        for name in names:
            median = statistics.median(times[name])
            print(
                f"  {name:>9}: {sent[name]:>11} bytes sent ({sent[name] / sent['bfloat16']:.4f} of bfloat16's), "
                f"{median * 1e3:8.2f} ms per gather ({median / statistics.median(times['bfloat16']):.2f} of bfloat16's)"
            )
    cut = [r * args.chunk for r in range(size + 1)]
    for kind, draw in (("one sign", "uniform"), ("both signs", "normal")):
        generator = np.random.default_rng([size, rank])
        x = (generator.uniform(0.5, 1.5, cut[-1]) if draw == "uniform" else generator.standard_normal(cut[-1])).astype(
            np.float32
        )
        line = []
        for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
            error, gamma = precision.relative_error(comm, x, cut, dtype)
            worst = comm.allreduce(error, op=MPI.MAX)
            line.append(f"{name} {worst:.3g} (bound {gamma:.3g}, {worst / gamma:.2f} of it)")
        if rank == 0:
            print(f"  reduction error, inputs of {kind}: " + "; ".join(line))


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--items", type=int, default=1_000_000, help="parameters in the gathered unit")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunk", type=int, default=65536, help="items per rank's chunk in the reduction")
    return bench_main(parser, child, TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
