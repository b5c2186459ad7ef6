"""Every 4-rank layout of lab 14's GPT on the mesh (ddlab.mesh) against pure data parallelism: time and memory.

One MPI job (4 ranks by default). Layouts data x tensor x pipeline: every one of the ranks
(4 ranks: 4x1x1, 2x2x1, 2x1x2, 1x4x1, 1x2x2, 1x1x4) and ZeRO-1/2/3 on the data dimension of
pure data parallelism. Each round every variant trains a fresh GPT (same weights) for
--steps steps plus one warm-up, taking turns, the order rotated each round; a variant's step
time is the slowest rank's median step, its memory each rank's peak in the memory ledger
(parameters, gradients, AdamW state, activations). Printed: per variant, the median over
rounds of its step time over data parallelism's in the same round, and its largest and
smallest rank's peak over data parallelism's (peaks do not vary between rounds). Pipelines
run 1F1B with --micro micro-batches.

    .venv/bin/python bench/mesh.py [--ranks 4] [--width 64] [--layers 4] [--block 32] [--batch 16] [--micro 2] [--rounds 5] [--steps 3]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import statistics
import sys

TIMEOUT = 3600


def child(args: argparse.Namespace) -> None:
    import torch
    from ddlab.data.text import BatchSampler, make_corpus
    from ddlab.mesh import layouts, train_on_mesh
    from ddlab.models.gpt import GPTConfig, make_gpt
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    size = comm.Get_size()
    config = GPTConfig(block_size=args.block, n_layer=args.layers, n_head=4, n_embd=args.width, tied=False)
    sampler = BatchSampler(make_corpus().train, batch=args.batch, block=args.block)
    variants = [(sizes, 0) for sizes in layouts(size)] + [(layouts(size)[0], zero) for zero in (1, 2, 3)]
    times: dict[int, list[float]] = {i: [] for i in range(len(variants))}
    peaks: dict[int, list[int]] = {}
    labels: dict[int, str] = {}
    for round_ in range(args.rounds):
        order = list(range(len(variants)))
        shift = round_ % len(order)
        for i in order[shift:] + order[:shift]:
            sizes, zero = variants[i]
            run = train_on_mesh(
                comm,
                make_gpt(config),
                sampler.batch_at,
                args.steps + 1,
                sizes["data"],
                sizes["tensor"],
                sizes["pipeline"],
                micro_batches=args.micro if sizes["pipeline"] > 1 else 1,
                zero=zero,
            )
            times[i].append(run.seconds)
            peaks[i], labels[i] = run.peak_bytes, run.label
    if comm.Get_rank() != 0:
        return
    print(
        f"GPT {config.n_layer} blocks of width {config.n_embd}, sequence {args.block}, batch {args.batch}, "
        f"{size} ranks, {args.rounds} rounds of {args.steps} steps; data parallel (4x1x1 on 4 ranks): "
        f"{statistics.median(times[0]) * 1e3:.1f} ms per step, peak {max(peaks[0]) / 2**20:.2f} MiB per rank"
    )
    print(f"{'layout':14} {'time / DP':>10} {'fastest round':>14} {'peak max / DP':>14} {'peak min / DP':>14}")
    for i in range(len(variants)):
        ratios = [t / base for t, base in zip(times[i], times[0])]
        print(
            f"{labels[i]:14} {statistics.median(ratios):10.2f} {min(ratios):14.2f} "
            f"{max(peaks[i]) / max(peaks[0]):14.2f} {min(peaks[i]) / max(peaks[0]):14.2f}"
        )


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    return bench_main(parser, child, TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
