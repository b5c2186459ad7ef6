"""Lab 11 measured: compressed gradients against the dense ring, hierarchical against flat under a slow link.

One MPI job of 4 ranks prints, side by side:

- the sparse allreduce's bytes per rank (counted by CountingComm) over the dense ring's at
  1% and 10% density of 2^20 float32, its time over the ring's at several densities, and
  the density above which the dense ring wins, predicted (fitted alpha, beta, gamma) and measured;
- for each method at 1% and 10% (top-k and random-k with and without error feedback; 8-bit
  QSGD and 1-bit signs, whose density is fixed, with error feedback): bytes per step and time
  per step over the dense ring's, and the test loss gap after --steps steps of lab 04's MLP;
- the hierarchical allreduce (groups of 2) over the flat ring, 1 KiB to 64 MiB, under the
  emulated Gigabit Ethernet link between groups, measured and predicted.

    .venv/bin/python bench/compression.py [--steps 200] [--part sparse|methods|hierarchical]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import sys

TIMEOUT = 1800
DENSITIES = (0.01, 0.03, 0.1, 0.2, 0.3, 0.5)
N = 2**20


def sparse(comm, steps: int) -> None:
    import numpy as np
    from ddlab.allreduce import allreduce_ring
    from ddlab.allreduce.cost import fit_link, time_allreduce
    from ddlab.compression import CompressedAllreduce, crossover_density, sparse_allreduce, top_k
    from ddlab.runtime.counting import CountingComm, gather_traffic

    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.random.default_rng(rank).standard_normal(N).astype(np.float32)

    def counted(fn, *args):
        counting = CountingComm(comm, timeout=60, allow=("Allgather", "Allgatherv"))
        fn(counting, *args)
        traffic = gather_traffic(counting)
        counting.free()
        return max(t.bytes_sent for t in traffic)

    ring_bytes = counted(allreduce_ring, x)
    sparse_bytes = {}
    for d in (0.01, 0.1):
        message = top_k(x, round(d * N))
        sparse_bytes[d] = counted(sparse_allreduce, message.indices, message.values, N)
    timed = {"dense ring": allreduce_ring}
    timed.update({f"{d:.0%}": CompressedAllreduce("topk", d, feedback=False) for d in DENSITIES})
    seconds = {name: np.median(s) for name, s in time_allreduce(comm, timed, [4 * N], repeats=5).items()}
    machine = fit_link(comm)
    if rank != 0:
        return
    print(f"{size} ranks; sparse allreduce of {N} float32 (bytes per rank, the most any rank sent)")
    for d, sent in sparse_bytes.items():
        print(f"  density {d:.0%}: {sent} bytes vs the dense ring's {ring_bytes}: {sent / ring_bytes:.3f}x")
    print(
        f"  time over the dense ring's ({1e3 * seconds['dense ring']:.2f} ms): "
        + ", ".join(f"{d:.0%} {seconds[f'{d:.0%}'] / seconds['dense ring']:.2f}" for d in DENSITIES)
    )
    slower = [d for d in DENSITIES if seconds[f"{d:.0%}"] > seconds["dense ring"]]
    measured = f"at or below {slower[0]:.0%}" if slower else f"not up to {DENSITIES[-1]:.0%}"
    print(
        f"  dense wins above: predicted {crossover_density(N, size, machine):.1%} "
        f"(alpha {machine.alpha:.2e} s, beta {machine.beta:.2e} s/B, gamma {machine.gamma:.2e} s/B), "
        f"measured {measured} (the first density measured slower than the ring)"
    )


def methods(comm, steps: int) -> None:
    from ddlab.compression import CompressedAllreduce
    from ddlab.compression.experiment import train_compressed

    settings = (
        [("dense", 1.0, True)]
        + [(m, d, f) for d in (0.01, 0.1) for m in ("topk", "randomk") for f in (True, False)]
        + [("qsgd8", 1.0, True), ("sign", 1.0, True)]
    )
    runs = [train_compressed(comm, CompressedAllreduce(m, d, f), steps) for m, d, f in settings]
    if comm.Get_rank() != 0:
        return
    dense = runs[0]
    print(
        f"\nlab 04's MLP, {steps} steps, SGD momentum 0.9; dense: test MSE {dense.loss:.4f}, "
        f"{dense.bytes_per_step:.0f} B/step, {1e3 * dense.seconds_per_step:.1f} ms/step"
    )
    print(f"{'method':>8} {'density':>7} {'EF':>3} | {'bytes/dense':>11} {'time/dense':>10} {'test MSE':>9} {'gap':>7}")
    for r in runs[1:]:
        print(
            f"{r.method:>8} {r.density:7.0%} {'yes' if r.feedback else 'no':>3} | "
            f"{r.bytes_per_step / dense.bytes_per_step:11.4f} {r.seconds_per_step / dense.seconds_per_step:10.2f} "
            f"{r.loss:9.4f} {r.loss / dense.loss - 1:+7.1%}"
        )


def hierarchical(comm, steps: int) -> None:
    import numpy as np
    from ddlab.allreduce import allreduce_ring
    from ddlab.allreduce.cost import time_allreduce
    from ddlab.compression import (
        GIGABIT_ETHERNET,
        SHARED_MEMORY,
        SlowLinkComm,
        emulated,
        flat_ring_seconds,
        hierarchical_allreduce,
        hierarchical_seconds,
    )

    size = comm.Get_size()
    slow = SlowLinkComm(comm, 2, GIGABIT_ETHERNET)
    sizes = [2**k for k in range(10, 27, 2)]
    algorithms = {"flat": allreduce_ring, "hierarchical": lambda c, v: hierarchical_allreduce(c, v, 2)}
    link = {name: np.median(s, axis=1) for name, s in time_allreduce(slow, algorithms, sizes, repeats=3).items()}
    if comm.Get_rank() != 0:
        return
    inter = emulated(GIGABIT_ETHERNET)
    flat_model = flat_ring_seconds(np.array(sizes), size, 2, SHARED_MEMORY, inter)
    hier_model = hierarchical_seconds(np.array(sizes), size, 2, SHARED_MEMORY, inter)
    print(
        f"\nhierarchical (groups of 2) over flat ring, emulated link alpha {GIGABIT_ETHERNET.alpha * 1e6:.0f} us, "
        f"{1 / GIGABIT_ETHERNET.beta / 1e6:.0f} MB/s between groups"
    )
    print(f"{'bytes':>10} {'flat ms':>9} {'hier ms':>9} {'hier/flat':>9} {'model':>7}")
    for i, nbytes in enumerate(sizes):
        print(
            f"{nbytes:>10} {1e3 * link['flat'][i]:9.2f} {1e3 * link['hierarchical'][i]:9.2f} "
            f"{link['hierarchical'][i] / link['flat'][i]:9.2f} {hier_model[i] / flat_model[i]:7.2f}"
        )


PARTS = {"sparse": sparse, "methods": methods, "hierarchical": hierarchical}


def child(steps: int, parts: list[str]) -> None:
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    for part in parts:
        PARTS[part](MPI.COMM_WORLD, steps)


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--part", choices=list(PARTS), action="append", help="run only this part (repeatable)")
    return bench_main(parser, lambda a: child(a.steps, a.part or list(PARTS)), TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
