"""Low precision across ranks (ddlab.precision, lab 18): the float8 all-gather and a reduction's error against P.

On each rank count (--ranks, default 2 4 8; more ranks than cores run oversubscribed):

1. The all-gather of a ZeRO-3 unit of --items parameters (float32 shards), three ways, with MPI's
   Allgatherv (`ddlab.sharded.allgather_mpi`): float32, bfloat16 (its bits as int16) and float8 E4M3
   with each rank's scale (`ddlab.precision.float8_allgather`). Bytes sent by all ranks, counted through
   `ddlab.runtime.counting.CountingComm` with lab 03's ring (each chunk to the P - 1 others), and the
   time per gather (median over --rounds, the slowest rank's, the three taking turns), as ratios over
   bfloat16's and float32's: with the casts (float8_allgather's whole call) and on the wire alone (the
   shard's bytes already cast, gathered). float8's bytes are half of bfloat16's plus 4 (P - 1) per rank for
   the scales.
2. The error of a ring reduce-scatter rounded at every hop (`ddlab.precision.reduce_scatter_rounded`) to
   bfloat16 and to float32, for inputs of one sign (uniform in [0.5, 1.5]: nothing cancels) and of both
   (normal): the largest |computed - exact| / sum_i |x_i| over every element, beside Higham's bound
   gamma_P = P u / (1 - P u) (Higham 2002, section 4.2).

A verdict line per target, the measured ratio beside it: float8's bytes at most half of bfloat16's and a
quarter of float32's, plus the scales; float8's time on the wire at most bfloat16's and float32's (a target
for a quiet machine: under load the times are noise); each reduction's error at most its bound. The time
with the casts has no target: on one host the transfer is a memory copy and the emulated cast (a pass over
the shard, and one back) costs more than the bytes it saves, which pays on links slower than memory.

One command, for a quiet machine; about 2 minutes with the defaults on 2 cores (an estimate, not a
measurement: `--ranks 2 4 --items 100000 --rounds 3 --chunk 8192` took 58 s at load average 22, most of it
starting MPI, torch and the ranks; the defaults move 10 times the bytes, 7 rounds, and add 8 ranks
oversubscribed):

    .venv/bin/python bench/precision.py [--ranks 2 4 8] [--items 1000000] [--rounds 7] [--chunk 65536]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from ddlab.sharded.collectives import Allgather
    from mpi4py import MPI

#: One way of gathering: run(comm, allgather).
Run = Callable[[Any, Any], Any]
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
    # the wire alone: what each gather sends, already cast (float8's scales are a second, tiny gather)
    q, _ = precision.quantize_float8(torch.from_numpy(mine).view(1, -1), torch.float8_e4m3fn, (1, shard))
    pieces = {
        "float32": mine,
        "bfloat16": torch.from_numpy(mine).to(torch.bfloat16).view(torch.int16).numpy(),
        "float8": q.view(torch.uint8).numpy().reshape(-1),
    }
    wires = {name: (lambda c, gather, piece=piece: gather(c, piece, bounds)) for name, piece in pieces.items()}
    names = list(gathers)
    times, wire = timed(comm, gathers, allgather_mpi, args.rounds), timed(comm, wires, allgather_mpi, args.rounds)
    if rank == 0:
        print(f"P = {size}: all-gather of {bounds[-1]} parameters ({shard} per rank)")
        for name in names:
            print(
                f"  {name:>9}: {sent[name]:>11} bytes sent ({sent[name] / sent['bfloat16']:.4f} of bfloat16's, "
                f"{sent[name] / sent['float32']:.4f} of float32's); per gather {times[name] * 1e3:8.2f} ms with the "
                f"casts ({times[name] / times['bfloat16']:.2f} of bfloat16's, {times[name] / times['float32']:.2f} of "
                f"float32's), {wire[name] * 1e3:8.2f} ms on the wire ({wire[name] / wire['bfloat16']:.2f}, "
                f"{wire[name] / wire['float32']:.2f})"
            )
        scales = 4 * size * (size - 1)  # each rank's float32 scale to the P - 1 others
        for other, share in (("bfloat16", 0.5), ("float32", 0.25)):
            ratio, target = sent["float8"] / sent[other], (share * sent[other] + scales) / sent[other]
            verdict(f"P = {size}: float8 / {other} bytes", ratio, target)
        for other in ("bfloat16", "float32"):
            verdict(f"P = {size}: float8 / {other} time on the wire", wire["float8"] / wire[other], 1.0)
    cut = [r * args.chunk for r in range(size + 1)]
    errors: list[tuple[str, float]] = []
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
            errors.append((f"P = {size}: {name} reduction error / its bound, inputs of {kind}", worst / gamma))
        if rank == 0:
            print(f"  reduction error, inputs of {kind}: " + "; ".join(line))
    if rank == 0:
        for what, ratio in errors:
            verdict(what, ratio, 1.0)


def timed(comm: MPI.Comm, runs: Mapping[str, Run], gather: Allgather, rounds: int) -> dict[str, float]:
    """Per name, the median over `rounds` (after one to warm up) of the slowest rank's seconds for
    runs[name](comm, gather), the runs taking turns so that a change of load falls on all of them."""
    from mpi4py import MPI

    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds + 1):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            comm.Barrier()
            start = time.perf_counter()
            runs[name](comm, gather)
            took = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if round_:  # the first round warms up
                times[name].append(took)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def verdict(what: str, measured: float, target: float) -> None:
    """One line per target: the measured ratio beside it, met or missed."""
    print(f"  verdict: {what} {measured:.4f} (target <= {target:.4f}): {'met' if measured <= target else 'missed'}")


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
