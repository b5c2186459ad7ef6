"""Lab 10 measured side by side: consistency modes with a straggler, steady against transient, a server against allreduce.

One MPI job of 4 ranks: rank 0 is the server, ranks 1-3 the workers, in every mode.
The decentralized modes (allreduce, gossip) run on ranks 1-3 alone while rank 0 waits
(`train_on_workers`), so every mode trains with the same 3 workers and the same
straggler. It prints:

- modes: time to reach a fixed loss (twice the loss synchronous allreduce ends at) for
  each mode over synchronous allreduce's, with one seeded worker at 2x compute and
  without, median over rounds (the modes take turns in a rotated order each round), and
  the staleness of asynchronous and stale-synchronous (s = 2) updates;
- stragglers: steady against transient (Ho et al., NeurIPS 2013), lab 10's replay at full
  size and measured: time to 90 updates, and the loss after them, for s = 0 (BSP), 1, 2, 3
  and asynchronous, with the same slow steps (3x compute, one worker in each step) taken
  all by one worker or by a seeded random worker per spell of 2 steps; beside each, what
  `replay` predicts on a clock;
- cost: seconds per step, no compute, of a synchronous single server (rank 0) with 3
  workers against lab 03's ring allreduce and MPI's allreduce over the same 3 workers,
  as the parameter count grows.

    .venv/bin/python bench/parameter_server.py [--rounds 3] [--part modes|stragglers|cost]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

TIMEOUT = 1800
MODES = ("allreduce", "sync", "ssp2", "async", "gossip")
SIZES = (2**10, 2**14, 2**17, 2**20, 2**22)
WORKERS = 3
COMPUTE = 0.01  # seconds per step of a worker at normal speed
BOUNDS = (0, 1, 2, 3, math.inf)
UPDATES, SPELL, SLOW = 90, 2, 3.0
PARTS = ("modes", "stragglers", "cost")


def modes(comm, rounds: int) -> None:
    import numpy as np
    from ddlab.parameter_server import LeastSquares
    from ddlab.parameter_server.run import Record, train_on_workers

    servers = comm.Get_size() - WORKERS
    problem = LeastSquares(n=32, samples=1024, batch=16)
    steps, lr = 60, 0.05

    def run(mode: str, factor: float) -> Record:
        return train_on_workers(
            comm, mode, problem, steps, lr, servers=servers, compute=COMPUTE, straggler=factor, seed=1
        )

    target = 2 * run("allreduce", 1.0).curve[-1][2]
    ratios: dict[tuple[float, str], list[float]] = {}
    stale: dict[str, list[int]] = {"ssp2": [], "async": []}
    for round_ in range(rounds):
        order = MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]
        for factor in (2.0, 1.0):
            times = {}
            for mode in order:
                record = run(mode, factor)
                times[mode] = record.time_to(target)
                if mode in stale and factor == 2.0:
                    stale[mode] += record.staleness
            for mode in MODES:
                ratios.setdefault((factor, mode), []).append(times[mode] / times["allreduce"])
    if comm.Get_rank() != 0:
        return
    print(
        f"{servers} server rank, {WORKERS} workers in every mode; least squares n=32, {steps} steps of "
        f"{COMPUTE * 1e3:.0f} ms compute, target loss {target:.4f} (2x allreduce's final), {rounds} rounds, median"
    )
    print("time to target / synchronous allreduce's (inf: never reached in the steps run)")
    print(f"{'mode':>10} {'2x straggler':>13} {'no straggler':>13}")
    for mode in MODES:
        print(f"{mode:>10} {statistics.median(ratios[2.0, mode]):13.2f} {statistics.median(ratios[1.0, mode]):13.2f}")
    for mode, values in stale.items():
        counts = np.bincount(values)
        print(
            f"staleness of {mode} updates (2x straggler): mean {np.mean(values):.2f}, max {max(values)}, "
            f"histogram {counts.tolist()}"
        )


def stragglers(comm, rounds: int) -> None:
    import numpy as np
    from ddlab.parameter_server import LeastSquares
    from ddlab.parameter_server.replay import replay
    from ddlab.parameter_server.run import train_on_workers
    from ddlab.parameter_server.straggler import steady, transient

    servers = comm.Get_size() - WORKERS
    problem = LeastSquares(n=16, samples=512, batch=16)  # lab 10's problem and learning rate
    lr = 0.5
    # Workers may run twice the steps BSP needs: asynchronous training's fast workers never run
    # out before the UPDATES-th update.
    steps = 2 * UPDATES // WORKERS
    kinds = {
        "steady": steady(WORKERS, steps, SLOW, seed=1),
        "transient": transient(WORKERS, steps, SLOW, spell=SPELL, seed=1),
    }
    at: dict[tuple[str, float], list[tuple[float, float]]] = {}
    for round_ in range(rounds):
        for kind, schedule in kinds.items():
            for bound in BOUNDS[round_ % len(BOUNDS) :] + BOUNDS[: round_ % len(BOUNDS)]:
                mode = "async" if bound == math.inf else f"ssp{bound}"
                record = train_on_workers(
                    comm, mode, problem, steps, lr, servers=servers, compute=COMPUTE, schedule=schedule
                )
                at.setdefault((kind, bound), []).append(record.at_step(UPDATES / WORKERS))
    if comm.Get_rank() != 0:
        return
    replayed = {
        (kind, s): replay(problem, schedule, s, lr, UPDATES) for kind, schedule in kinds.items() for s in BOUNDS
    }
    best = problem.loss(np.linalg.lstsq(problem.X, problem.y, rcond=None)[0])
    print(
        f"\nsteady vs transient straggler, {WORKERS} workers: time to {UPDATES} updates and the loss after them; "
        f"least squares n=16, lr {lr}, {COMPUTE * 1e3:.0f} ms compute, slow steps {SLOW:g}x (one worker in each "
        f"step; transient: a seeded worker per spell of {SPELL} steps); measured (median of {rounds}) "
        f"and replayed on a clock; lowest possible loss {best:.4f}"
    )
    print(f"{'straggler':>9} {'bound':>5} | {'ms':>6} {'/ s=0':>6} {'replay / s=0':>12} | {'loss':>7} {'replay':>7}")
    for kind in kinds:
        base = statistics.median(t for t, _ in at[kind, 0])
        for bound in BOUNDS:
            seconds = statistics.median(t for t, _ in at[kind, bound])
            loss = statistics.median(v for _, v in at[kind, bound])
            run = replayed[kind, bound]
            print(
                f"{kind:>9} {'async' if bound == math.inf else bound:>5} | {seconds * 1e3:6.0f} {seconds / base:6.2f} "
                f"{run.times[-1] / replayed[kind, 0].times[-1]:12.2f} | {loss:7.4f} {problem.loss(run.history[-1]):7.4f}"
            )


def cost(comm, rounds: int) -> None:
    from ddlab.allreduce import allreduce_ring
    from ddlab.parameter_server.cost import seconds_per_step

    servers = comm.Get_size() - WORKERS
    methods = {
        "server": {"mode": "sync"},
        "ring": {"mode": "allreduce", "allreduce": allreduce_ring},
        "MPI": {"mode": "allreduce"},
    }
    per_step = {
        (n, name): statistics.median(
            seconds_per_step(comm, workers=WORKERS, n=n, servers=servers, steps=10, **how) for _ in range(rounds)
        )
        for n in SIZES
        for name, how in methods.items()
    }
    if comm.Get_rank() != 0:
        return
    print(
        f"\nseconds per step, no compute, {WORKERS} workers: synchronous server (one more rank) "
        "vs lab 03's ring and MPI's allreduce over the workers"
    )
    print(f"{'parameters':>11} {'server ms':>10} {'ring ms':>8} {'MPI ms':>7} {'server/ring':>12} {'server/MPI':>11}")
    for n in SIZES:
        server, ring, mpi = (per_step[n, name] for name in methods)
        print(
            f"{n:11d} {server * 1e3:10.2f} {ring * 1e3:8.2f} {mpi * 1e3:7.2f} {server / ring:12.2f} "
            f"{server / mpi:11.2f}"
        )


def child(rounds: int, parts: list[str]) -> None:
    from mpi4py import MPI

    for part in parts:
        {"modes": modes, "stragglers": stragglers, "cost": cost}[part](MPI.COMM_WORLD, rounds)


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--part", choices=PARTS, action="append", help="run only this part (repeatable); all by default"
    )
    return bench_main(parser, lambda a: child(a.rounds, a.part or list(PARTS)), TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
