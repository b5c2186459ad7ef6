"""Every 4-rank layout of lab 14's GPT on the mesh (ddlab.mesh) against pure data parallelism, and the oracle's prediction.

One MPI job (4 ranks by default). Layouts data x tensor x pipeline: every one of the ranks
(4 ranks: 4x1x1, 2x2x1, 2x1x2, 1x4x1, 1x2x2, 1x1x4), every product of the ranks that includes
context parallelism (lab 15's ring attention; 4 ranks: 1x1x1x4, 2x1x1x2, 1x2x1x2, 1x1x2x2,
data x tensor x pipeline x context), ZeRO-1/2/3 on the data dimension of pure data
parallelism, and the interleaved 1F1B schedule with v = 2 chunks per pipeline rank on every layout
whose pipeline it fits (--layers a multiple of 2p, --micro of p; 4 ranks and the defaults: 2x1x2 v2 and
1x2x2 v2). Each round every variant trains a fresh GPT (same weights) for
--steps steps plus one warm-up, taking turns, the order rotated each round; a variant's step
time is the slowest rank's median step, its memory each rank's peak in the memory ledger
(parameters, gradients, AdamW state, activations). Pipelines run 1F1B with --micro
micro-batches (the interleaved variants v m chunk slots of 1F1B's order, `interleaved_1f1b`).

The oracle (`ddlab.oracle.transformer_local`): before the rounds, this machine is measured
as lab 09 measures it (`measure_platform`: collectives' curves, ping-pong, sync); at the start
of every round the compute rate is calibrated from one process training the same GPT alone,
the contention from every rank training it at once and sync measured again (inputs of the round, the same for
every layout: no factor per layout), and each layout's step is predicted. Printed: per
variant, the median over rounds of its step time over data parallelism's in the same round,
its largest and smallest rank's peak over data parallelism's; then per layout the measured
and predicted step time (medians over rounds) and their accuracy 1 - |pred - meas| / meas,
the measured and predicted peak of the worst-predicted rank and the memory accuracy (the
worst rank's), each round's measured and predicted step, and the means, over every variant, ZeRO's included (the oracle walks lab 13's
engine for its memory and prices its collectives unit by unit). Targets (issues 30 and 40): mean time
accuracy >= 0.85, no layout below 0.70, memory accuracy >= 0.95 on every layout. Context
layouts are calibrated with ring attention's own arithmetic too (`calibrate`, `ring_arithmetic`).

    .venv/bin/python bench/mesh.py [--ranks 4] [--width 128] [--layers 4] [--block 32] [--batch 32] [--micro 2] [--rounds 3] [--steps 5]

The defaults make the calibration's steps (one rank on a quarter of the batch) several of the
scheduler's time slices long; at width 64 and batch 16 they last about 15 ms and the measured
contention moves from round to round (docs/benchmarks.md).

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

TIMEOUT = 3600


def child(args: argparse.Namespace) -> None:
    import torch
    from ddlab.data.text import BatchSampler, make_corpus
    from ddlab.mesh import DIMS, layouts, train_on_mesh
    from ddlab.models.gpt import GPTConfig, make_gpt
    from ddlab.oracle.measure import measure_platform
    from ddlab.oracle.transformer_local import calibrate, case_of, predict_mesh
    from mpi4py import MPI

    started = time.perf_counter()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    size = comm.Get_size()
    config = GPTConfig(block_size=args.block, n_layer=args.layers, n_head=4, n_embd=args.width, tied=False)
    sampler = BatchSampler(make_corpus().train, batch=args.batch, block=args.block)
    with_context = [sizes for sizes in layouts(size, DIMS) if sizes["context"] > 1]
    interleaved = [
        (sizes, 0, 2)
        for sizes in layouts(size)
        if sizes["pipeline"] > 1 and args.layers % (2 * sizes["pipeline"]) == 0 and args.micro % sizes["pipeline"] == 0
    ]
    variants = [(sizes, 0, 1) for sizes in layouts(size) + with_context]
    variants += [(layouts(size)[0], zero, 1) for zero in (1, 2, 3)] + interleaved
    times: dict[int, list[float]] = {i: [] for i in range(len(variants))}
    predicted: dict[int, list] = {i: [] for i in range(len(variants))}
    peaks: dict[int, list[int]] = {}
    labels: dict[int, str] = {}
    measured = measure_platform(comm)
    platforms = []
    for round_ in range(args.rounds):
        platform = calibrate(
            comm, measured, config, lambda: make_gpt(config), sampler.batch_at, args.batch, args.block, args.steps
        )
        platforms.append(platform)
        order = list(range(len(variants)))
        shift = round_ % len(order)
        for i in order[shift:] + order[:shift]:
            sizes, zero, virtual = variants[i]
            micro = args.micro if sizes["pipeline"] > 1 else 1
            run = train_on_mesh(
                comm,
                make_gpt(config),
                sampler.batch_at,
                args.steps + 1,
                sizes["data"],
                sizes["tensor"],
                sizes["pipeline"],
                micro_batches=micro,
                zero=zero,
                context=sizes["context"],
                virtual=virtual,
            )
            times[i].append(run.seconds)
            peaks[i], labels[i] = run.peak_bytes, run.label
            case = case_of(sizes, args.batch, args.block, micro, zero=zero, virtual=virtual)
            predicted[i].append(predict_mesh(config, case, platform))
    if comm.Get_rank() != 0:
        return
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"GPT {config.n_layer} blocks of width {config.n_embd}, sequence {args.block}, batch {args.batch}, "
        f"{size} ranks, {args.rounds} rounds of {args.steps} steps; load average {load}; data parallel "
        f"({labels[0]}): {statistics.median(times[0]) * 1e3:.1f} ms per step, peak {max(peaks[0]) / 2**20:.2f} MiB per rank"
    )
    print(f"{'layout':14} {'time / DP':>10} {'fastest round':>14} {'peak max / DP':>14} {'peak min / DP':>14}")
    for i in range(len(variants)):
        ratios = [t / base for t, base in zip(times[i], times[0])]
        print(
            f"{labels[i]:14} {statistics.median(ratios):10.2f} {min(ratios):14.2f} "
            f"{max(peaks[i]) / max(peaks[0]):14.2f} {min(peaks[i]) / max(peaks[0]):14.2f}"
        )
    per_layer = ", ".join(f"{p.overheads['gpt layer'] * 1e3:.2f}" for p in platforms)
    ring = ", ".join(
        f"{p.overheads['ring block'] * 1e3:.2f} ms + {1e-9 / p.overheads['ring flop']:.2f} GFLOP/s"
        for p in platforms
        if p.overheads.get("ring flop")
    )
    print(
        f"\nThe oracle (per round: {per_layer} ms per layer step + {', '.join(f'{p.flops / 1e9:.2f}' for p in platforms)} GFLOP/s alone, "
        f"slowdown with {size} ranks computing {', '.join(f'{p.contention[-1]:.2f}' for p in platforms)}; "
        f"sync {', '.join(f'{p.sync * 1e3:.2f}' for p in platforms)} ms per blocking exchange; "
        f"ring attention's arithmetic alone {ring or 'not calibrated'} per block)"
    )
    links = [
        ("p2p", 128 * 2**10, 2),
        ("allreduce", 4 * 2**20, size),
        ("allgather", 2**20, size),
        ("reduce_scatter", 2**20, size),
    ]
    print(
        "The curves, measured before the rounds (ms): "
        + "; ".join(
            f"{op} {nbytes // 2**10} KiB on {n}: {platforms[0].comm(op, nbytes, n) * 1e3:.3f}"
            for op, nbytes, n in links
        )
    )
    print(
        f"{'layout':13} {'meas ms':>8} {'pred ms':>8} {'(compute/bubble/tensor/context/pipe/data/sync)':>48} {'time acc':>8} "
        f"{'each round':>24} | {'meas KiB':>9} {'pred KiB':>9} {'mem acc':>7}"
    )
    time_acc, memory_acc = [], []
    for i, runs in predicted.items():
        meas, pred = statistics.median(times[i]), statistics.median(p.time for p in runs)
        middle = sorted(runs, key=lambda p: p.time)[len(runs) // 2]
        time_acc.append(1 - abs(pred - meas) / meas)
        memory_acc.append(middle.memory_accuracy(peaks[i]))
        worst = min(range(size), key=lambda r: 1 - abs(middle.peaks()[r] - peaks[i][r]) / peaks[i][r])
        parts = "/".join(
            f"{middle.seconds[k] * 1e3:.1f}"
            for k in ("compute", "bubble", "tensor", "context", "pipeline", "data", "sync")
        )
        each = " ".join(f"{p.time_accuracy(t):.2f}" for p, t in zip(runs, times[i]))
        print(
            f"{labels[i]:13} {meas * 1e3:8.1f} {pred * 1e3:8.1f} {parts:>48} {time_acc[-1]:8.3f} {each:>24} | "
            f"{peaks[i][worst] / 2**10:9.1f} {middle.peaks()[worst] / 2**10:9.1f} {memory_acc[-1]:7.4f}"
        )
    print("Each round, measured / predicted ms (a miss in one round is its measurement's or its prediction's):")
    for i, runs in predicted.items():
        print(f"{labels[i]:13} " + "  ".join(f"{t * 1e3:6.1f} / {p.time * 1e3:6.1f}" for p, t in zip(runs, times[i])))
    context = [acc for i, acc in enumerate(time_acc) if variants[i][0]["context"] > 1]
    if context:
        print(f"context layouts: mean time accuracy {statistics.mean(context):.3f}, lowest {min(context):.3f}")
    print(
        f"mean time accuracy over all {len(time_acc)} variants {statistics.mean(time_acc):.3f} (target 0.85), "
        f"lowest {min(time_acc):.3f} ({labels[time_acc.index(min(time_acc))]}, target 0.70); "
        f"memory accuracy lowest {min(memory_acc):.4f} (target 0.95 on every layout); "
        f"this run took {time.perf_counter() - started:.0f} s"
    )


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    return bench_main(parser, child, TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
