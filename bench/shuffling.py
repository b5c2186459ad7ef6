"""Lab 12's shuffling strategies side by side: shared-storage bytes and validation loss against global.

One MPI job of 4 ranks writes the 4096-sample stress-strain set, sorted by yield strength,
as the "shared file system" copy, and trains the lab-04 MLP (with per-rank BatchNorm) for
8 epochs under global, local and partial-local shuffling (Q = 0.1, 0.3, 1), for several
seeds; then, as controls, global and local shuffling again with BatchNorm's statistics
synchronised over ranks ("synced") and with no BatchNorm ("none"). It prints, per strategy:

- bytes read from the shared copy per epoch (staging included, spread over the run) over
  global's, bytes sent to other ranks over global's shared bytes;
- the final validation MSE (mean over seeds, and the seeds' range), and its gap to global's.

Then whether partial-local with Q = 0.3 ends within 5% of global's loss while reading
<= 0.35x its shared bytes, whether local-only is worse than every seed of global, and local's
final MSE over global's under each BatchNorm: per-rank statistics, synchronised, none.

    .venv/bin/python bench/shuffling.py [--seeds 3] [--epochs 8]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import sys

TIMEOUT = 1800
STRATEGIES = {
    "global": ("global", 0.0),
    "local": ("local", 0.0),
    "Q=0.1": ("partial", 0.1),
    "Q=0.3": ("partial", 0.3),
    "Q=1": ("partial", 1.0),
}
CONTROLS = {f"{name} {norm}": (name, norm) for norm in ("synced", "none") for name in ("global", "local")}


def child(seeds: int, epochs: int) -> None:
    import numpy as np
    import torch
    from ddlab.data import StressStrainCurves
    from ddlab.shuffling import remove_store, train_shuffled, write_shared
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    root = write_shared(comm, StressStrainCurves(4096, seed=0))
    runs = {name: [] for name in STRATEGIES}
    controls = {name: [] for name in CONTROLS}
    try:
        for seed in range(seeds):
            for name, (strategy, q) in STRATEGIES.items():
                runs[name].append(
                    train_shuffled(comm, root, strategy, q, epochs=epochs, batch_size=32, lr=0.02, seed=seed)
                )
            for name, (strategy, norm) in CONTROLS.items():
                controls[name].append(
                    train_shuffled(
                        comm, root, strategy, epochs=epochs, batch_size=32, lr=0.02, seed=seed, batch_norm=norm
                    )
                )
    finally:
        remove_store(comm, root)
    if comm.Get_rank() != 0:
        return

    print(
        f"{comm.Get_size()} ranks, 4096 samples sorted by yield strength (non-IID partitions), "
        f"{epochs} epochs, batch 32 per rank, {seeds} seeds"
    )
    shared = {name: np.mean([sum(r["shared"]) for r in rs]) / epochs for name, rs in runs.items()}
    sent = {name: np.mean([sum(r["exchanged"]) for r in rs]) / epochs for name, rs in runs.items()}
    final = {name: np.array([r["val_loss"][-1] for r in rs]) for name, rs in runs.items()}
    base = final["global"].mean()
    print(
        f"{'strategy':>8} {'shared MB/epoch':>15} {'/ global':>8} {'sent / global':>13} "
        f"{'final MSE':>9} {'seeds range':>15} {'gap to global':>13}"
    )
    for name in runs:
        print(
            f"{name:>8} {shared[name] / 1e6:15.2f} {shared[name] / shared['global']:8.3f} "
            f"{sent[name] / shared['global']:13.3f} {final[name].mean():9.4f} "
            f"{final[name].min():7.4f}-{final[name].max():7.4f} {100 * (final[name].mean() / base - 1):+12.1f}%"
        )
    gap = final["Q=0.3"].mean() / base - 1
    ratio = shared["Q=0.3"] / shared["global"]
    print(
        f"\nQ=0.3 within 5% of global's loss ({100 * gap:+.1f}%) and <= 0.35x its shared bytes ({ratio:.3f}x): "
        f"{'met' if gap <= 0.05 and ratio <= 0.35 else 'missed'}"
    )
    worse = final["local"].min() > final["global"].max()
    print(
        f"local-only worse than global on every seed (best local {final['local'].min():.4f} vs worst global "
        f"{final['global'].max():.4f}, mean {final['local'].mean() / base:.1f}x): {'met' if worse else 'missed'}"
    )
    print("\ncontrols: final MSE mean (seeds range), local over global")
    print(
        f"  per-rank BatchNorm: global {final['global'].mean():.4f}, local {final['local'].mean():.4f}, "
        f"{final['local'].mean() / base:.2f}x"
    )
    for norm in ("synced", "none"):
        g, loc = (np.array([r["val_loss"][-1] for r in controls[f"{name} {norm}"]]) for name in ("global", "local"))
        print(
            f"  {norm + ' BatchNorm' if norm == 'synced' else 'no BatchNorm':>18}: global {g.mean():.4f} "
            f"({g.min():.4f}-{g.max():.4f}), local {loc.mean():.4f} ({loc.min():.4f}-{loc.max():.4f}), "
            f"{loc.mean() / g.mean():.2f}x"
        )


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    return bench_main(parser, lambda a: child(a.seeds, a.epochs), TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
