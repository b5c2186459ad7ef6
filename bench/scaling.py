"""Lab 05's sweeps: the batch-size sweep at equal wall-clock, and MPI's Allreduce against gloo's.

For each rank count, one MPI job trains the lab's MLP with DataParallel (SGD with momentum,
square-root rule for the learning rate: 0.01 at the smallest batch; one math thread per rank,
as the lab's engines on 2 cores: on a loaded machine two threads per rank are slower) for the same wall-clock
budget at each global batch of the source study's range, 75 to 5000, rounded to multiples of
the ranks: 80, 160, ..., 5120 (the same 64-67x span). Per batch: seconds per epoch, the
allreduces counted in a full epoch against the formula (batches per epoch), the epochs done,
R^2 and MSE on held-out tests when the budget is spent, and the time to reach a target R^2;
ratios against the smallest batch beside them. The batches take turns, each round in another
order, and each figure is the median over rounds. Then MPI's Allreduce against
torch.distributed's gloo all_reduce on the same float32 arrays, 16 B to 64 MiB, taking turns
(on more than one rank).

    .venv/bin/python bench/scaling.py [--ranks 1 4] [--seconds 8] [--rounds 2] [--target 0.5]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import os
import sys

TIMEOUT = 1800
BATCHES = (80, 160, 320, 640, 1280, 2560, 5120)
N = 16_384


def child(seconds: float, rounds: int, target: float) -> None:
    """Inside the MPI job: both sweeps, printed by rank 0."""
    import numpy as np
    from ddlab.data_parallel import close_gloo
    from ddlab.scaling import allreduce_vs_gloo, syncs_per_epoch, time_to_score, train_for_time
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    runs: dict[int, list[dict]] = {b: [] for b in BATCHES}
    for round_ in range(rounds):
        order = BATCHES[round_ % len(BATCHES) :] + BATCHES[: round_ % len(BATCHES)]
        for b in order if round_ % 2 == 0 else order[::-1]:
            runs[b].append(train_for_time(comm, seconds, b, 0.01 * (b / BATCHES[0]) ** 0.5, n=N, threads=1))
    if rank == 0:
        print(
            f"\n{size} rank(s) on {os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f} at the end), "
            f"{N} samples, {seconds:g} s of training per batch, median of {rounds} rounds"
        )
        print(
            f"{'batch':>5} {'s/epoch':>8} {'ratio':>6} {'syncs/epoch':>11} {'formula':>7} {'epochs':>6} "
            f"{'R^2':>6} {'MSE':>8} {'MSE ratio':>9} {'to R^2 ' + format(target, 'g'):>10}"
        )
        median = lambda b, key: float(np.median([r[key] for r in runs[b]]))  # noqa: E731
        for b in BATCHES:
            syncs = sorted({c for r in runs[b] for c in r["allreduces"]})
            reached = [time_to_score(r["times"], r["scores"], target) for r in runs[b]]
            hit = [t for t in reached if t is not None]
            final = float(np.median([r["scores"][-1] for r in runs[b]]))
            print(
                f"{b:5d} {median(b, 'epoch_time'):8.3f} {median(b, 'epoch_time') / median(BATCHES[0], 'epoch_time'):6.2f} "
                f"{','.join(map(str, syncs)) or '-':>11} {syncs_per_epoch(N, b, size):7d} {median(b, 'epochs'):6.1f} "
                f"{final:6.3f} {median(b, 'mse'):8.4f} {median(b, 'mse') / median(BATCHES[0], 'mse'):9.2f} "
                f"{(f'{np.median(hit):.2f} s' if len(hit) == len(reached) else 'not always'):>10}",
                flush=True,
            )
    if size == 1:
        return
    sizes = [2**k for k in range(4, 27, 2)]
    versus = allreduce_vs_gloo(comm, sizes, repeats=5)
    close_gloo()
    if rank == 0:
        print(f"\nallreduce of float32 arrays on {size} rank(s), fastest of 5 repeats, taking turns")
        print(f"{'bytes':>9} {'MPI (us)':>10} {'gloo (us)':>10} {'gloo / MPI':>10}")
        for nbytes, mpi, gloo in zip(sizes, versus["MPI Allreduce"], versus["gloo all_reduce"]):
            print(f"{nbytes:9d} {1e6 * mpi:10.1f} {1e6 * gloo:10.1f} {gloo / mpi:10.2f}")
        sys.stdout.flush()


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.5)
    return bench_main(parser, lambda a: child(a.seconds, a.rounds, a.target), TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
