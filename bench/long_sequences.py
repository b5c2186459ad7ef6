"""Long sequences (lab 15): ring attention's memory, the causal load balance, and overlap.

One MPI job (4 ranks by default), causal attention over S positions (--length), --heads heads
of 16 (float64), ratios measured side by side in one run:

1. Peak attention bytes per rank, forward and backward (tracemalloc: every NumPy buffer,
   the score tiles included), of ring attention on P ranks (max over ranks) over the same code
   on one process (one block of S x S). Goal: <= 0.30 on 4 ranks.
2. Causal compute per rank, max over mean, contiguous split against zig-zag: the scores each
   rank computes (counted from the layout, blocks in the future skipped) and the measured CPU
   time of each rank's block computations (median of --rounds; CPU time, since 4 ranks on 2
   cores wait for a core at random, which wall time would count). Goal: zig-zag <= 1.10; contiguous
   about 1.75 in pairs the mask keeps ((2P-1)/P), 2P/(P+1) in whole blocks.
3. Ring attention forward time with the messages overlapped with compute over waiting for each
   block before computing (median of --rounds, the two alternating).
4. Ring attention against Ulysses (an all-to-all to a head split), forward, on the zig-zag
   split: bytes each rank sends to other ranks (counted, beside the formulas: ring 2 (P-1) H n e b, Ulysses
   4 H n e b (P-1)/P, n = S/P rows, e the head width, b bytes a number), peak traced bytes per
   rank (beside the scores the formulas predict: ring one n x n tile per head, Ulysses (H/P) S x S),
   and the time of a forward (max over ranks, median of --rounds, the two alternating). --heads
   must be a multiple of P for Ulysses.
5. The mixture of experts (bench/experts.py, run in the same job): all-to-all bytes against the
   formula, tokens dropped per capacity factor, expert load with and without the balancing loss
   after --steps training steps, and the MoE layer's step time over the dense MLP's.

    .venv/bin/python bench/long_sequences.py [--ranks 4] [--length 1024] [--heads 2] [--rounds 21] [--steps 300] [--sections memory balance overlap ulysses experts]

More sections plug in through SECTIONS (name -> function(comm, args, say)). It relaunches
itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from typing import Any, Callable

TIMEOUT = 3600
WIDTH = 16  # per head

Say = Callable[[str], None]


def _inputs(args: argparse.Namespace) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(15)
    return [rng.standard_normal((args.heads, args.length, WIDTH)) for _ in range(4)]  # q, k, v, grad_out


def attention_memory(comm: Any, args: argparse.Namespace, say: Say) -> None:
    """Section 1: peak traced bytes of forward + backward, ring on P ranks over one process."""
    from ddlab.context_parallel import all_positions, ring_attention, ring_attention_backward, take_rows
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    whole = _inputs(args)

    def peak(sub: Any) -> int:
        positions = all_positions(args.length, sub.Get_size())
        mine = [take_rows(a, positions[sub.Get_rank()]) for a in whole]
        tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out, lse = ring_attention(sub, *mine[:3], positions)
        ring_attention_backward(sub, *mine[:3], out, lse, mine[3], positions)
        top = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        return top

    one = peak(MPI.COMM_SELF) if rank == 0 else 0
    comm.Barrier()
    ring = comm.allreduce(peak(comm), op=MPI.MAX)
    one = comm.bcast(one)
    say(f"\n1. peak attention bytes, forward + backward, S = {args.length}, {args.heads} heads of {WIDTH}, float64")
    say(f"  one process {one / 2**20:.1f} MiB, ring on {size} ranks {ring / 2**20:.2f} MiB per rank (max)")
    say(f"  ratio {ring / one:.3f} (goal <= 0.30; 1/P = {1 / size:.2f})")


def causal_balance(comm: Any, args: argparse.Namespace, say: Say) -> None:
    """Section 2: each rank's causal work, contiguous and zig-zag, counted and timed."""
    import numpy as np
    from ddlab.context_parallel import all_positions, attend_block, causal_pairs, causal_work, take_rows

    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, _ = _inputs(args)
    say(f"\n2. causal attention compute per rank, max over mean, S = {args.length}, {size} ranks")
    for name, zigzag in (("contiguous", False), ("zig-zag", True)):
        positions = all_positions(args.length, size, zigzag)
        mine = take_rows(q, positions[rank])
        blocks = [(take_rows(k, p), take_rows(v, p), p) for p in positions]
        times = []
        for _ in range(args.rounds):
            comm.Barrier()
            start = time.process_time()
            for key, value, where in blocks:
                attend_block(mine, key, value, positions[rank], where)
            times.append(time.process_time() - start)
        measured = np.array(comm.allgather(statistics.median(times)))
        work, pairs = causal_work(positions), causal_pairs(positions, args.length)
        say(
            f"  {name:10}: scores computed {work.max() / work.mean():.3f}, pairs the mask keeps "
            f"{pairs.max() / pairs.mean():.3f}, measured CPU time {measured.max() / measured.mean():.3f} "
            f"(per rank {', '.join(f'{t * 1e3:.1f}' for t in measured)} ms)"
        )
    say("  goal: zig-zag <= 1.10; contiguous about (2P-1)/P in pairs, 2P/(P+1) in whole blocks")


def overlap(comm: Any, args: argparse.Namespace, say: Say) -> None:
    """Section 3: ring forward time, messages overlapped with compute vs waited for first."""
    from ddlab.context_parallel import all_positions, ring_attention, take_rows
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    positions = all_positions(args.length, size)
    mine = [take_rows(a, positions[rank]) for a in _inputs(args)[:3]]
    times: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for overlapped in (True, False) if round_ % 2 == 0 else (False, True):
            comm.Barrier()
            start = time.perf_counter()
            ring_attention(comm, *mine, positions, overlap=overlapped)
            times[overlapped].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    with_, without = statistics.median(times[True]), statistics.median(times[False])
    say(f"\n3. ring attention forward on {size} ranks, S = {args.length}: median of {args.rounds} rounds")
    say(f"  overlapped {with_ * 1e3:.1f} ms, waiting first {without * 1e3:.1f} ms: ratio {with_ / without:.3f}")


def ring_against_ulysses(comm: Any, args: argparse.Namespace, say: Say) -> None:
    """Section 4: ring attention and Ulysses forward, side by side: bytes, peak memory, time per rank."""
    from ddlab.context_parallel import all_positions, ring_attention, take_rows, ulysses_attention
    from ddlab.runtime.counting import CountingComm, gather_traffic
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    say(f"\n4. ring attention against Ulysses, forward, S = {args.length}, {args.heads} heads of {WIDTH}, {size} ranks")
    if args.heads % size:
        say(f"  skipped: Ulysses needs the heads ({args.heads}) to be a multiple of the ranks ({size}); use --heads")
        return
    positions = all_positions(args.length, size)
    mine = [take_rows(a, positions[rank]) for a in _inputs(args)[:3]]
    n, bytes_ = positions.shape[1], mine[0].itemsize
    runs = {"ring": ring_attention, "Ulysses": ulysses_attention}
    formula = {
        "ring": 2 * (size - 1) * args.heads * n * WIDTH * bytes_,
        "Ulysses": 4 * args.heads * n * WIDTH * bytes_ * (size - 1) / size,
    }
    scores = {"ring": args.heads * n * n * bytes_, "Ulysses": args.heads // size * (n * size) ** 2 * bytes_}
    sent, peak = {}, {}
    for name, attend in runs.items():
        counting = CountingComm(comm, allow=("Alltoall",))
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        attend(counting, *mine, positions)
        peak[name] = comm.allreduce(tracemalloc.get_traced_memory()[1] - base, op=MPI.MAX)
        tracemalloc.stop()
        mine_sent = sum(e.nbytes for e in gather_traffic(counting)[rank].sends if e.peer != rank)  # not the block kept
        sent[name] = comm.allreduce(mine_sent, op=MPI.MAX)
        counting.free()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        for name in runs if round_ % 2 == 0 else reversed(list(runs)):
            comm.Barrier()
            start = time.perf_counter()
            runs[name](comm, *mine, positions)
            times[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    for name in runs:
        say(
            f"  {name:8}: sent {sent[name] / 2**10:8.1f} KiB per rank (formula {formula[name] / 2**10:8.1f}), "
            f"peak {peak[name] / 2**20:7.2f} MiB per rank (scores by the formula {scores[name] / 2**20:7.2f}), "
            f"{statistics.median(times[name]) * 1e3:7.1f} ms per forward"
        )
    ring, ulysses = (statistics.median(times[name]) for name in runs)
    say(
        f"  Ulysses over ring: bytes {sent['Ulysses'] / max(sent['ring'], 1):.3f}, peak {peak['Ulysses'] / peak['ring']:.3f}, time {ulysses / ring:.3f}"
    )


def mixture_of_experts(comm: Any, args: argparse.Namespace, say: Say) -> None:
    """Part 2: bench/experts.py's all-to-all bytes, dropped tokens, balance and step time."""
    from experts import run  # bench/experts.py: this script's folder is on sys.path

    say("")
    run(comm, args.steps, args.rounds)


#: The measurements, by name, in the order they run.
SECTIONS: dict[str, Callable[[Any, argparse.Namespace, Say], None]] = {
    "memory": attention_memory,
    "balance": causal_balance,
    "overlap": overlap,
    "ulysses": ring_against_ulysses,
    "experts": mixture_of_experts,
}


def child(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD

    def say(text: str) -> None:
        if comm.Get_rank() == 0:
            print(text, flush=True)

    say(f"long sequences on {comm.Get_size()} ranks (timings are only as quiet as the machine)")
    for name in args.sections:
        SECTIONS[name](comm, args, say)


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4])
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--length", type=int, default=1024, help="sequence length S")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=300, help="training steps of each balance run (experts)")
    return bench_main(parser, child, TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
