"""The lab 09 oracle against measured runs: accuracy of predicted time and memory per strategy.

One MPI job of 4 ranks measures this machine (`measure_platform`), then for each strategy
of labs 04-08 (`ddlab.oracle.validate.RUNS`: data parallel MLP, the UNet as 4 layer
stages with M=1 and pipelined with M=4 under 1F1B, spatial, filter, data x spatial)
predicts a training step and runs it, and prints, per strategy, accuracy = 1 - |pred -
meas| / meas (ParaDL's measure) of the time per iteration and of the peak memory per
rank (the worst rank), then the means. Targets: memory >= 0.95 for every strategy;
time >= 0.85 on average and >= 0.75 for each.

    .venv/bin/python bench/oracle.py [--steps 7] [--scale 2]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

TIMEOUT = 1800


def child(steps: int, scale: int) -> None:
    import torch
    from ddlab.oracle import measure_platform
    from ddlab.oracle.validate import run_all
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    platform = measure_platform(comm)
    results = run_all(comm, platform, steps=steps, scale=scale)
    if comm.Get_rank() != 0:
        return
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"load average {load}; {comm.Get_size()} ranks; contention (1..P ranks computing) {[round(c, 2) for c in platform.contention]}"
    )
    print(
        f"{'strategy':28} {'pred ms':>8} {'(comp/comm/bubble/over)':>24} {'meas ms':>8} {'time acc':>8} | "
        f"{'pred MiB':>8} {'meas MiB':>8} {'mem acc':>7}"
    )
    for v in results:
        p = v.prediction
        worst = min(range(len(v.memory)), key=lambda r: v.memory_accuracies[r])
        parts = "/".join(f"{getattr(p, k) * 1e3:.0f}" for k in ("compute", "communication", "bubble", "overhead"))
        print(
            f"{v.name:28} {p.time * 1e3:8.1f} {parts:>24} {v.seconds * 1e3:8.1f} {v.time_accuracy:8.3f} | "
            f"{v.predicted_peak(worst) / 2**20:8.2f} {v.measured_peak(worst) / 2**20:8.2f} {v.memory_accuracy:7.3f}"
        )
    times = [v.time_accuracy for v in results]
    memories = [v.memory_accuracy for v in results]
    print(
        f"mean time accuracy {statistics.mean(times):.3f} (target 0.85), lowest {min(times):.3f} (target 0.75); "
        f"mean memory accuracy {statistics.mean(memories):.3f}, lowest {min(memories):.3f} (target 0.95)"
    )


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--scale", type=int, default=2, help="batch multiple of the notebook's sizes")
    return bench_main(parser, lambda a: child(a.steps, a.scale), TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
