"""Lab 08's table: the largest image each strategy trains under 32 MiB per rank, and at what cost.

One MPI job of 4 ranks trains the lab's UNet (width 8, depth 4, a batch of two, SGD with
momentum, float32) two steps per configuration, at sides from 64 in steps of 16 until every
configuration runs out of memory, under the same per-rank `Ledger` budget as lab 06:
one process (rank 0 alone), lab 06's naive and balanced layer splits, spatial (4 slabs),
hybrid data x spatial (2 x 2) and filter parallel (4-way). It prints:

- the table: time per sample (ms) or OOM per side and configuration, and the largest side;
- each configuration's largest side over one process's;
- halo bytes sent per rank and step over the rank's peak activation bytes (spatial);
- each configuration's time per sample over one process's at the largest side all fit;
- every rank's peak MiB at the first side each configuration misses, as far as the ledger
  got under the budget, and for lab 08's strategies what a run there without a budget needs
  (replicated parameters, gradients and momentum + activations).

    .venv/bin/python bench/intra_layer.py

It relaunches itself under mpiexec (`ddlab.runtime.mpi.bench_main`).
"""

from __future__ import annotations

import argparse
import sys

TIMEOUT = 3600
BUDGET = 32 * 2**20


def child(start: int, step: int) -> None:
    import torch
    from ddlab.intra_layer import COLUMNS, STRATEGIES, halo_share, intra_sweep, markdown_table, try_strategy
    from ddlab.models.unet import UNet
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = UNet(width=8, depth=4)
    results, side = [], start
    while True:
        found = intra_sweep(comm, model, [side], BUDGET)
        results += found
        if not any(r.fits for r in found):
            break
        side += step
    shares = comm.gather(halo_share(comm, model, 128), root=0)
    largest = {c: max((r.side for r in results if r.split == c and r.fits), default=0) for c in COLUMNS}
    needs = {s: try_strategy(comm, model, largest[s] + step, s, budget=None) for s in STRATEGIES}
    if comm.Get_rank() != 0:
        return
    print(f"{comm.Get_size()} ranks, UNet(width=8, depth=4), batch 2, 32 MiB per rank; ms per sample or OOM\n")
    print(markdown_table(results))
    by = {(r.split, r.side): r for r in results}
    print(
        "\nlargest side over one process's: "
        + ", ".join(f"{c} {largest[c] / largest['one process']:.2f}" for c in COLUMNS[1:])
    )
    print(
        "halo bytes per step / peak activation bytes, spatial at side 128, per rank: "
        + ", ".join(f"{sent / acts:.4f}" for sent, acts in shares)
    )
    common = max(s for s in {r.side for r in results} if all(by[c, s].fits for c in COLUMNS))
    base = by["one process", common].seconds_per_sample
    print(
        f"time per sample over one process's at side {common}: "
        + ", ".join(f"{c} {by[c, common].seconds_per_sample / base:.2f}" for c in COLUMNS[1:])
    )
    print("\nper-rank peak MiB at the first side each configuration misses:")
    for c in COLUMNS:
        miss = by.get((c, largest[c] + step))
        if miss is not None:
            print(
                f"  {c:12} side {miss.side}: "
                + "/".join(f"{p / 2**20:.1f}" for p in miss.peak_per_rank)
                + f"  ({(miss.error or '').split(';')[0]})"
            )
    print("\nwhat lab 08's strategies need there without a budget, per rank, MiB (replicated state + activations):")
    for s, need in needs.items():
        print(
            f"  {s:12} side {need.side}: "
            + ", ".join(
                f"{p['peak'] / 2**20:.2f} ({(p['parameters'] + p['gradients'] + p['optimizer']) / 2**20:.2f}"
                f" + {p['activations'] / 2**20:.2f})"
                for p in need.peaks
            )
        )
    spatial = largest["spatial"]
    ok = spatial >= 1.8 * largest["one process"] and spatial > largest["balanced"]
    print(f"\nspatial >= 1.8 x one process and > balanced split: {'met' if ok else 'missed'}")


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--start", type=int, default=64)
    parser.add_argument("--step", type=int, default=16)
    return bench_main(parser, lambda a: child(a.start, a.step), TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
