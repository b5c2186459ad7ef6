"""Lab 15's mixture of experts side by side on 4 ranks: all-to-all bytes, dropped tokens, balance, step time.

1. Bytes per step: one forward and backward of a MoE layer (d = 64, 512 tokens per rank,
   8 experts, capacity factor 2.0, k = 1 and 2) through a CountingComm. The rows travel in four
   Alltoallvs (out and back, forward and backward); the bytes all ranks send to other ranks are
   printed over the exact count, 4 d b x (kept rows whose expert is on another rank), and over
   the even-routing estimate 4 k T d b (P - 1) / P per rank; the counts' Alltoall besides.
2. Balance: a small GPT whose two MLPs are MoE layers (8 experts, k = 1, capacity factor 1.25,
   the dense fallback, one process per run) trains on lab 14's text for --steps steps without
   and with Switch Transformer's balancing loss (alpha = 0.01), two seeds each: the four runs on
   the four ranks at once. Then, on validation batches: expert load max/mean (before dropping;
   mean over layers and batches) and the fraction of assignments dropped at capacity factors
   1.0, 1.25 and 2.0.
3. Step time: forward and backward of the MoE layer on 4 ranks (8 experts, k = 1, capacity
   factor 1.25, 1024 tokens of width 64 per rank) over the dense MLP with the same active
   parameters (one expert's: d -> 4d -> d) on the same tokens; medians of --rounds rounds,
   the two measured alternately.

    .venv/bin/python bench/experts.py [--steps 300] [--rounds 20]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main). Inside an MPI job,
`run(comm, steps, rounds)` measures and prints on rank 0 (bench/long_sequences.py can call it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

TIMEOUT = 1800
CAPACITY_FACTORS = (1.0, 1.25, 2.0)
ALPHA = 0.01


def bytes_per_step(comm: Any, k: int) -> tuple[float, float, int]:
    """(row bytes to other ranks over the exact count, over the even estimate, counts' bytes), all ranks."""
    import numpy as np
    import torch
    from ddlab.experts import MoE
    from ddlab.runtime.counting import CountingComm

    rank, size = comm.Get_rank(), comm.Get_size()
    d, tokens, experts = 64, 512, 8
    counting = CountingComm(comm, timeout=300, allow=("Alltoall", "Alltoallv"))
    layer = MoE(d, experts, k, 2.0, counting, seed=3)
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    layer(x).square().sum().backward()
    counting.free()
    sends = counting.traffic.sends  # each call logs one send per rank, in the order of the calls
    by_call = [(name, sends[i * size : (i + 1) * size]) for i, name in enumerate(counting.traffic.calls)]
    away = {name: 0 for name in ("Alltoall", "Alltoallv")}
    for name, events in by_call:
        away[name] += sum(e.nbytes for e in events if e.peer != rank)
    expert_rank = layer.routing.expert.numpy() // (experts // size)
    exact = 4 * int(np.count_nonzero(expert_rank != rank)) * d * 4
    estimate = 4 * k * tokens * d * 4 * (size - 1) / size
    rows = comm.allreduce(away["Alltoallv"])
    return rows / comm.allreduce(exact), rows / comm.allreduce(estimate), comm.allreduce(away["Alltoall"])


def train_and_measure(run: int, steps: int) -> dict[str, Any]:
    """One run: with the balancing loss if run is odd; seed run // 2. Load max/mean and drops after training."""
    import numpy as np
    import torch
    from ddlab.data.text import BatchSampler, make_corpus
    from ddlab.experts import aux_loss, use_experts
    from ddlab.models.gpt import GPTConfig, make_gpt

    balanced, seed = run % 2 == 1, run // 2
    corpus = make_corpus(seed=0)
    config = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=32)
    model = make_gpt(config, seed=seed)
    layers = use_experts(model, n_experts=8, k=1, capacity_factor=1.25, seed=seed)
    train = BatchSampler(corpus.train, 16, config.block_size, seed=1 + seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        x, y = train.batch_at(step)
        _, loss = model(x, y)
        assert loss is not None
        total = loss + ALPHA * aux_loss(layers) if balanced else loss
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
    val = BatchSampler(corpus.val, 16, config.block_size, seed=7)
    ratios, dropped = [], {f: 0.0 for f in CAPACITY_FACTORS}
    with torch.no_grad():
        for factor in CAPACITY_FACTORS:
            for layer in layers:
                layer.capacity_factor = factor
            for b in range(4):
                model(val.batch_at(b)[0])
                for layer in layers:
                    dropped[factor] += layer.dropped / (4 * len(layers) * int(layer.load.sum()))
                    if factor == 1.25:
                        load = layer.load.double()
                        ratios.append(float(load.max() / load.mean()))
    return {"balanced": balanced, "loss": float(loss.detach()), "ratio": float(np.mean(ratios)), "dropped": dropped}


def step_times(comm: Any, rounds: int) -> tuple[float, float]:
    """Median seconds of forward + backward: the MoE layer on comm's ranks, and the dense MLP on one."""
    import torch
    from ddlab.experts import MoE
    from ddlab.experts.layer import Expert
    from mpi4py import MPI

    d, tokens = 64, 1024
    moe = MoE(d, 8, 1, 1.25, comm, seed=5)
    dense = Expert(d, 4 * d)
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(comm.Get_rank())).requires_grad_()
    times: dict[str, list[float]] = {"moe": [], "dense": []}
    for _ in range(rounds + 2):  # two warm-up rounds
        for name, layer in (("moe", moe), ("dense", dense)):
            comm.Barrier()
            start = time.perf_counter()
            layer(x).square().sum().backward()
            times[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return statistics.median(times["moe"][2:]), statistics.median(times["dense"][2:])


def run(comm: Any, steps: int = 300, rounds: int = 20) -> None:
    """Measure the three parts on comm (4 ranks expected) and print them on rank 0."""
    import torch

    torch.set_num_threads(1)
    rank, size = comm.Get_rank(), comm.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"Mixture of experts on {size} ranks")
    for k in (1, 2):
        exact, estimate, counts = bytes_per_step(comm, k)
        say(
            f"  bytes per step, k={k}: rows to other ranks / exact count {exact:.3f}, "
            f"/ even-routing estimate 4kTdb(P-1)/P {estimate:.3f}; counts' Alltoall {counts} B in all"
        )
    runs = comm.gather(train_and_measure(rank, steps) if rank < 4 else None, root=0)
    if rank == 0:
        done = [r for r in runs if r is not None]
        for balanced in (False, True):
            mine = [r for r in done if r["balanced"] == balanced]
            label = f"with balancing loss (alpha {ALPHA})" if balanced else "without balancing loss    "
            drops = ", ".join(f"cf {f}: {sum(r['dropped'][f] for r in mine) / len(mine):.1%}" for f in CAPACITY_FACTORS)
            ratio = ", ".join(f"{r['ratio']:.2f}" for r in mine)
            loss = ", ".join(f"{r['loss']:.2f}" for r in mine)
            say(f"  {steps} steps {label}: load max/mean {ratio} (seeds); dropped {drops}; last loss {loss}")
    moe, dense = step_times(comm, rounds)
    say(
        f"  step time (forward + backward), MoE on {size} ranks / dense MLP of the same active parameters: "
        f"{moe * 1e3:.2f} ms / {dense * 1e3:.2f} ms = {moe / dense:.2f}x (measured under whatever load there is)"
    )


def child(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    run(MPI.COMM_WORLD, args.steps, args.rounds)


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps of each balance run")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds of the step-time comparison")
    return bench_main(parser, child, TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
