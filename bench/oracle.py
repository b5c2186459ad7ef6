"""The lab 09 oracle against measured runs: accuracy of predicted time and memory per strategy.

One MPI job of 4 ranks measures this machine (`measure_platform`), then for each strategy
of labs 04-08 (`ddlab.oracle.validate.RUNS`: data parallel MLP, the UNet as 4 layer
stages with M=1 and pipelined with M=4 under 1F1B, spatial, filter, data x spatial)
predicts a training step and runs it, and prints, per strategy, accuracy = 1 - |pred -
meas| / meas (ParaDL's measure) of the time per iteration and of the peak memory per
rank (the worst rank), then the means. Targets: memory >= 0.95 for every strategy;
time >= 0.85 on average and >= 0.75 for each.

The machine is shared: its load moves from minute to minute, which no prediction made
before a run can know. So, as the other benches do, the whole comparison runs `--rounds`
times in a row, each round profiling, predicting and running every strategy afresh, and
the accuracy compares the median prediction with the median measurement of each strategy
(each round's accuracies are printed too). The seconds one run took are printed last.

    .venv/bin/python bench/oracle.py [--steps 7] [--scale 2] [--rounds 3]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

TIMEOUT = 1800


def child(steps: int, scale: int, rounds: int) -> None:
    import time

    import torch
    from ddlab.oracle import measure_platform
    from ddlab.oracle.validate import accuracy, run_all
    from mpi4py import MPI

    start = time.perf_counter()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    platform = measure_platform(comm)
    runs = [run_all(comm, platform, steps=steps, scale=scale) for _ in range(rounds)]
    if comm.Get_rank() != 0:
        return
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"load average {load}; {comm.Get_size()} ranks; {rounds} rounds; "
        f"contention (1..P ranks computing) {[round(c, 2) for c in platform.contention]}"
    )
    print(
        f"{'strategy':28} {'pred ms':>8} {'(comp/comm/bubble/over)':>24} {'meas ms':>8} {'time acc':>8} "
        f"{'each round':>20} | {'pred MiB':>8} {'meas MiB':>8} {'mem acc':>7}"
    )
    times, memories = [], []
    for results in zip(*runs):  # one strategy, every round
        middle = sorted(results, key=lambda v: v.prediction.time)[len(results) // 2]
        p = middle.prediction
        predicted = statistics.median(v.prediction.time for v in results)
        measured = statistics.median(v.seconds for v in results)
        times.append(accuracy(predicted, measured))
        memories.append(min(v.memory_accuracy for v in results))
        worst = min(range(len(middle.memory)), key=lambda r: middle.memory_accuracies[r])
        parts = "/".join(f"{getattr(p, k) * 1e3:.0f}" for k in ("compute", "communication", "bubble", "overhead"))
        each = " ".join(f"{v.time_accuracy:.2f}" for v in results)
        print(
            f"{middle.name:28} {predicted * 1e3:8.1f} {parts:>24} {measured * 1e3:8.1f} {times[-1]:8.3f} {each:>20} | "
            f"{middle.predicted_peak(worst) / 2**20:8.2f} {middle.measured_peak(worst) / 2**20:8.2f} {memories[-1]:7.3f}"
        )
    print(
        f"mean time accuracy {statistics.mean(times):.3f} (target 0.85), lowest {min(times):.3f} (target 0.75); "
        f"mean memory accuracy {statistics.mean(memories):.3f}, lowest {min(memories):.3f} (target 0.95); "
        f"this run took {time.perf_counter() - start:.0f} s"
    )


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--scale", type=int, default=2, help="batch multiple of the notebook's sizes")
    parser.add_argument("--rounds", type=int, default=3, help="comparisons in a row; medians of their times")
    return bench_main(parser, lambda a: child(a.steps, a.scale, a.rounds), TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
