"""Lab 10 measured side by side: consistency modes with a straggler, and a server against allreduce.

One MPI job of 4 ranks prints:

- time to reach a fixed loss (twice the loss synchronous allreduce ends at) for each
  mode over synchronous allreduce's, with one seeded worker at 2x compute and without,
  median over rounds (the modes take turns in a rotated order each round), and the
  staleness of asynchronous and stale-synchronous (s = 2) updates;
- seconds per step of a synchronous single server (1 server, 3 workers) and of MPI's
  allreduce (4 workers) as the parameter count grows, with no compute.

    .venv/bin/python bench/parameter_server.py [--rounds 3]

It relaunches itself under mpiexec (ddlab.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import statistics
import sys

TIMEOUT = 1800
MODES = ("allreduce", "sync", "ssp2", "async", "gossip")
SIZES = (2**10, 2**14, 2**17, 2**20)


def child(rounds: int) -> None:
    import numpy as np
    from mpi4py import MPI

    from ddlab.parameter_server import LeastSquares, train

    comm = MPI.COMM_WORLD
    problem = LeastSquares(n=32, samples=1024, batch=16)
    steps, compute, lr = 60, 0.01, 0.05
    target = 2 * train(comm, "allreduce", problem, steps, lr, compute=compute).curve[-1][2]
    ratios: dict[tuple[float, str], list[float]] = {}
    stale: dict[str, list[int]] = {"ssp2": [], "async": []}
    for round_ in range(rounds):
        order = MODES[round_ % len(MODES):] + MODES[:round_ % len(MODES)]
        for factor in (2.0, 1.0):
            times = {}
            for mode in order:
                record = train(comm, mode, problem, steps, lr, compute=compute, straggler=factor, seed=1)
                times[mode] = record.time_to(target)
                if mode in stale and factor == 2.0:
                    stale[mode] += record.staleness
            for mode in MODES:
                ratios.setdefault((factor, mode), []).append(times[mode] / times["allreduce"])
    per_step = {}
    for n in SIZES:
        big = LeastSquares(n=n, samples=2, batch=1)
        for mode in ("sync", "allreduce"):
            per_step[n, mode] = statistics.median(train(comm, mode, big, 10, lr).seconds / 10 for _ in range(rounds))
    if comm.Get_rank() != 0:
        return
    print(f"{comm.Get_size()} ranks, least squares n=32, {steps} steps of {compute * 1e3:.0f} ms compute, "
          f"target loss {target:.4f} (2x allreduce's final), {rounds} rounds, median")
    print("time to target / synchronous allreduce's (inf: never reached in the steps run)")
    print(f"{'mode':>10} {'2x straggler':>13} {'no straggler':>13}")
    for mode in MODES:
        print(f"{mode:>10} {statistics.median(ratios[2.0, mode]):13.2f} {statistics.median(ratios[1.0, mode]):13.2f}")
    for mode, values in stale.items():
        counts = np.bincount(values)
        print(f"staleness of {mode} updates (2x straggler): mean {np.mean(values):.2f}, max {max(values)}, "
              f"histogram {counts.tolist()}")
    print("\nseconds per step, no compute: synchronous server (1 server, 3 workers) vs MPI allreduce (4 ranks)")
    print(f"{'parameters':>11} {'server ms':>10} {'allreduce ms':>13} {'server/allreduce':>17}")
    for n in SIZES:
        server, allreduce = per_step[n, "sync"], per_step[n, "allreduce"]
        print(f"{n:11d} {server * 1e3:10.2f} {allreduce * 1e3:13.2f} {server / allreduce:17.2f}")


def main() -> int:
    from ddlab.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    return bench_main(parser, lambda a: child(a.rounds), TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
