"""ddlab's DataParallel against torch's DistributedDataParallel, overlap on and off, bucket caps.

For each rank count, one MPI job trains two models with per-rank batches of 64: the
lab's MLP (148k parameters, 0.6 MB of gradients) and a wide MLP (600-2048-2048-1024-2,
7.5M parameters, 30 MB). Variants, all SGD with momentum, same data:

- ddlab: DataParallel, MPI Iallreduce, 25 MB buckets, overlap on (the default);
- ddp: torch DistributedDataParallel on gloo, 25 MB buckets;
- no overlap: ddlab with every bucket started after backward;
- thread: ddlab with a helper thread waiting on the allreduces (progress="thread");
- cap 1 MB, cap none: ddlab with other bucket caps.

The variants take turns in every round, each round starting with the next one (so
machine load and order effects hit them alike); the table shows each one's time per
step, the median over rounds and the fastest round (load from other programs only
adds time), and their ratios. Below it, per
ddlab variant, the time per step of each phase on rank 0 (the profile that explains a
ratio), and the share of a step spent waiting in the allreduce without overlap.

    .venv/bin/python bench/data_parallel.py [--ranks 2 4] [--rounds 15] [--steps 5]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import os
import sys

TIMEOUT = 1800
WIDE = (2048, 2048, 1024)


def child(rounds: int, steps: int) -> None:
    """Inside the MPI job: measure every variant on both models, print on rank 0."""
    import numpy as np
    import torch
    from ddlab import data_parallel as dp
    from ddlab.data import StressStrainCurves
    from ddlab.models.mlp import HIDDEN, count_parameters, make_mlp
    from ddlab.runtime.trace import Tracer
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    threads = dp.threads_per_rank()
    dp.init_gloo(comm)
    data = StressStrainCurves()
    variants = {
        "ddlab": dict(bucket_cap_mb=25.0),
        "ddp": None,
        "no overlap": dict(bucket_cap_mb=25.0, overlap=False),
        "thread": dict(bucket_cap_mb=25.0, progress="thread"),
        "cap 1 MB": dict(bucket_cap_mb=1.0),
        "cap none": dict(bucket_cap_mb=None),
    }
    if rank == 0:
        load = os.getloadavg()[0]
        print(
            f"\n{size} ranks, {threads} thread(s) each, on {os.cpu_count()} cores "
            f"(load average {load:.1f} at the start), batch 64 per rank, median of {rounds} rounds "
            f"of {steps} steps",
            flush=True,
        )
    for hidden, name in ((HIDDEN, "lab MLP"), (WIDE, "wide MLP")):
        models, optimizers, tracers = {}, {}, {}
        for variant, options in variants.items():
            module = make_mlp(hidden=hidden)
            if options is None:
                models[variant] = dp.torch_ddp(module)
            else:
                tracers[variant] = Tracer(rank)
                models[variant] = dp.DataParallel(module, comm, tracer=tracers[variant], **options)
            optimizers[variant] = torch.optim.SGD(models[variant].parameters(), lr=1e-3, momentum=0.9)
        seconds = {variant: [] for variant in variants}
        names = list(models)
        for round_ in range(rounds + 1):
            for variant in names[round_ % len(names) :] + names[: round_ % len(names)]:  # rotate the order
                model = models[variant]
                if variant in tracers:
                    tracers[variant].enabled = round_ > 0
                comm.Barrier()
                history = dp.train(
                    model,
                    optimizers[variant],
                    data,
                    comm,
                    batch_size=64,
                    max_steps=steps,
                    seed=round_,
                    progress=False,
                    tracer=tracers.get(variant),
                )
                step = comm.allreduce(history.step_time(), op=MPI.MAX)
                if round_:  # round 0 warms up
                    seconds[variant].append(step)
        median = {variant: float(np.median(s)) for variant, s in seconds.items()}
        best = {variant: float(np.min(s)) for variant, s in seconds.items()}
        if rank != 0:
            continue
        nbytes = 4 * count_parameters(make_mlp(hidden=hidden))
        print(f"\n{name}: {nbytes / 2**20:.1f} MB of gradients")
        print(
            "  time per step, median (fastest round): "
            + ", ".join(f"{v} {1e3 * median[v]:.1f} ({1e3 * best[v]:.1f}) ms" for v in median)
        )
        for label, a, b in (
            ("ddlab / DDP", "ddlab", "ddp"),
            ("overlap on / off", "ddlab", "no overlap"),
            ("thread / off", "thread", "no overlap"),
            ("cap 1 MB / 25 MB", "cap 1 MB", "ddlab"),
            ("cap none / 25 MB", "cap none", "ddlab"),
        ):
            print(f"  {label:>17} = {median[a] / median[b]:.2f} (fastest rounds: {best[a] / best[b]:.2f})")
        for variant, tracer in tracers.items():
            per_step = {k: 1e3 * v / (rounds * steps) for k, v in tracer.totals().items()}
            buckets = len(models[variant].buckets)
            print(
                f"  {variant:>10} ({buckets} bucket{'s' * (buckets > 1)}), ms per step on rank 0: "
                + ", ".join(f"{k} {v:.1f}" for k, v in per_step.items())
            )
        waits = tracers["no overlap"].totals().get("allreduce", 0.0) / (rounds * steps)
        print(f"  allreduce waits without overlap: {100 * waits / median['no overlap']:.0f}% of a step")
        sys.stdout.flush()
    dp.close_gloo()


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    return bench_main(parser, lambda a: child(a.rounds, a.steps), TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
