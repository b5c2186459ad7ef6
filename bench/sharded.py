"""ZeRO-1/2/3 (ddlab.sharded) against data parallelism: memory, bytes sent, step time, largest model.

One MPI job (4 ranks by default), an MLP of Linear layers 600-w-...-w-2 (w = --width,
--layers hidden layers), batch 32 per rank, Adam. Four measurements, ratios over DDP's:

1. Model-state bytes per rank after a step, from a `ddlab.runtime.memory.Ledger` (parameters,
   gradients, optimizer state), and the peak including activations and gathered units.
   DDP is lab 04's DataParallel in float32 (4 + 4 + 8 = 16 bytes per parameter); ZeRO
   runs in mixed precision (bfloat16 compute, float32 masters and reduction), whose
   replicated total is 2 + 2 + 12 = 16 as well. The paper's ratios (Rajbhandari et al.,
   SC 2020, table 1 / figure 1, K = 12): (4 + 12/P)/16, (2 + 14/P)/16, (16/P)/16.
2. Bytes sent per step by all ranks (ddlab.runtime.counting.CountingComm, float32), ZeRO with lab
   03's ring halves and with MPI's Reduce_scatter/Allgatherv (counted as each rank's chunks sent
   to their owners), over DataParallel's with the ring allreduce: 1.0, 1.0, 1.5.
3. Time per step (float32, MPI's collectives) over DataParallel's: ZeRO-1, ZeRO-2,
   ZeRO-3 without and with prefetch, torch's ZeroRedundancyOptimizer (on DDP) and
   FSDP2's fully_shard per Linear, both on gloo. Variants take turns each round, order
   rotated; a round's time is the slowest rank's; median over rounds (and fastest round),
   and the median of the ratios within each round. ZeRO-3's waits for its collectives
   (ddlab.runtime.trace spans) say what prefetch hides. Then each one's model state per rank
   (ddlab.sharded.held_bytes, float32, the largest rank's) over DDP's.
4. The largest model (hidden layers of width w) each stage trains one step of under a
   fixed per-rank ledger budget (--budget MiB), over DDP's.
5. Hybrid sharding (HSDP, ddlab.sharded.HybridSharded; Zhao et al., "PyTorch FSDP", VLDB 2023,
   its sharding strategies), stage 3 in groups of G ranks, replicated across R = P/G: bytes sent
   from one group to another per step (counted, float32), over full sharding's (stage 3 on all
   P ranks), for every G dividing P, with lab 03's ring and with MPI's collectives, beside the
   formulas: 2/(3G) (MPI: chunks sent straight to their owners), 2(P-G)/(3(P-1)) (the ring).
6. Gradient accumulation over --micro micro-batches (ZeRO-2 and ZeRO-3): reduce-scatter every
   micro-batch against `no_sync` (accumulate the full gradient locally, reduce-scatter once):
   gradient bytes kept between micro-batches (ledger) and bytes sent per step (counted, float32).

    .venv/bin/python bench/sharded.py [--ranks 4] [--width 1024] [--layers 6] [--rounds 7] [--budget 32] [--search-width 512] [--micro 4] [--sections 1 2 3 4 5 6]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

TIMEOUT = 3600
BATCH = 32


def child(args: argparse.Namespace) -> None:
    import torch
    from ddlab import data_parallel as dp
    from ddlab import sharded
    from ddlab.data import StressStrainCurves
    from ddlab.models.mlp import count_parameters, make_mlp
    from ddlab.runtime.counting import CountingComm
    from ddlab.runtime.memory import Ledger, OutOfMemory
    from ddlab.runtime.trace import Tracer
    from mpi4py import MPI
    from torch import nn

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    dp.threads_per_rank()
    data = StressStrainCurves(n=BATCH * size * 4)
    x, y = data[list(range(rank * BATCH, (rank + 1) * BATCH))]

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    def mlp(layers: int = args.layers, width: int = args.width) -> nn.Module:
        return make_mlp(seed=1, hidden=(width,) * layers)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, ledger: Ledger | None = None) -> None:
        optimizer.zero_grad()
        if ledger is None:
            prediction = model(x)
        else:
            with ledger.activations():
                prediction = model(x)
        dp.squared_error(prediction.float(), y).mean().backward()
        optimizer.step()

    def build(
        stage: int,
        communicator: Any,
        ledger: Ledger | None = None,
        layers: int = args.layers,
        width: int = args.width,
        mixed: bool = False,
        **options: Any,
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """stage 0: lab 04's DataParallel in float32; 1-3: ddlab.sharded."""
        module = mlp(layers, width)
        if stage == 0:
            if ledger is not None:
                ledger.watch(module)  # before DataParallel, so gradients are charged as autograd makes them
            model = dp.DataParallel(module, communicator, **options)
            optimizer = torch.optim.Adam(module.parameters(), lr=1e-4)
            if ledger is not None:
                ledger.watch(nn.Module(), optimizer)
            return model, optimizer
        precision = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if mixed else {}
        model = sharded.Sharded(module, communicator, stage=stage, ledger=ledger, **precision, **options)
        return model, model.attach(torch.optim.Adam(model.shards(), lr=1e-4))

    def close(model: nn.Module) -> None:
        if isinstance(model, sharded.Sharded):
            model.close()
        elif isinstance(model, dp.DataParallel):
            model.remove_hooks()

    psi = count_parameters(mlp())
    say(
        f"\n{size} ranks, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; MLP 600-{args.width}x{args.layers}-2: "
        f"{psi / 1e6:.2f}M parameters, batch {BATCH} per rank, Adam"
    )

    names = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}

    # 1. Memory -------------------------------------------------------------------------------------
    if 1 in args.sections:
        paper = {0: 16.0, 1: 4 + 12 / size, 2: 2 + 14 / size, 3: 16 / size}
        state, peak, parts = {}, {}, {}
        for stage in range(4):
            ledger = Ledger()
            model, optimizer = build(stage, comm, ledger, mixed=True)
            for _ in range(2):
                step(model, optimizer, ledger)
            if isinstance(model, sharded.Sharded):
                model.synchronize()
            state[stage] = ledger.used["parameters"] + ledger.used["gradients"] + ledger.used["optimizer"]
            parts[stage] = {k: ledger.used[k] / psi for k in ("parameters", "gradients", "optimizer")}
            peak[stage] = ledger.peak_total
            close(model)
        say("\n1. model-state bytes per rank after a step (ledger), per parameter, and over DDP's")
        for stage in range(4):
            split = ", ".join(f"{k} {v:.2f}" for k, v in parts[stage].items())
            say(
                f"  {names[stage]:>7}: {state[stage] / psi:5.2f} B/param ({split}); "
                f"over DDP {state[stage] / state[0]:.3f} (paper {paper[stage] / 16:.3f}); "
                f"peak with activations and gathered units {peak[stage] / 2**20:.1f} MiB = {peak[stage] / peak[0]:.3f} of DDP's"
            )

    # 2. Bytes sent per step --------------------------------------------------------------------------
    if 2 in args.sections:
        sent: dict[tuple[int, str], int] = {}
        runs = [(0, "ring")] + [(stage, kind) for kind in ("ring", "mpi") for stage in (1, 2, 3)]
        for stage, kind in runs:
            counting = CountingComm(comm, timeout=300, allow=("Bcast", "Allgatherv", "Reduce_scatter"))
            model, optimizer = build(
                stage, counting, **({"allreduce": "ring"} if stage == 0 else {"collectives": kind})
            )
            step(model, optimizer)
            if isinstance(model, sharded.Sharded):
                model.synchronize()
            before = counting.traffic.bytes_sent
            step(model, optimizer)
            if isinstance(model, sharded.Sharded):
                model.synchronize()
            sent[stage, kind] = comm.allreduce(counting.traffic.bytes_sent - before)
            close(model)
            counting.free()
        say(
            "\n2. bytes sent per step, all ranks (counted, float32), over DDP's with the ring (paper: 1, 1, 1.5); "
            "ZeRO with lab 03's ring halves, then with MPI's Reduce_scatter and Allgatherv"
        )
        for kind in ("ring", "mpi"):
            say(
                f"  {kind}: "
                + ", ".join(
                    f"{names[s]} {sent[s, kind] / 2**20:.1f} MiB = {sent[s, kind] / sent[0, 'ring']:.3f}"
                    for s in (1, 2, 3)
                )
                + f" (DDP {sent[0, 'ring'] / 2**20:.1f} MiB)"
            )

    # 3. Step time --------------------------------------------------------------------------------------
    if 3 in args.sections:
        dp.init_gloo(comm)
        tracers = {name: Tracer(rank) for name in ("ZeRO-3", "ZeRO-3 prefetch 1", "ZeRO-3 prefetch 2")}
        models: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {
            "DDP": build(0, comm),
            "ZeRO-1": build(1, comm),
            "ZeRO-2": build(2, comm),
            "ZeRO-3": build(3, comm, tracer=tracers["ZeRO-3"]),
            "ZeRO-3 prefetch 1": build(3, comm, prefetch=1, tracer=tracers["ZeRO-3 prefetch 1"]),
            "ZeRO-3 prefetch 2": build(3, comm, prefetch=2, tracer=tracers["ZeRO-3 prefetch 2"]),
        }
        problems = {}
        try:
            models["torch ZeroRedundancyOptimizer"] = sharded.torch_zero(mlp(), torch.optim.Adam, lr=1e-4)
        except (RuntimeError, ValueError) as err:
            problems["torch ZeroRedundancyOptimizer"] = str(err)
        try:
            fsdp = sharded.torch_fsdp(mlp())
            models["torch FSDP2"] = (fsdp, torch.optim.Adam(fsdp.parameters(), lr=1e-4))
        except (RuntimeError, ValueError) as err:
            problems["torch FSDP2"] = str(err)
        seconds: dict[str, list[float]] = {name: [] for name in models}
        cpu_seconds: dict[str, list[float]] = {name: [] for name in models}  # CPU time of a rank, mean over ranks
        order = list(models)
        for round_ in range(args.rounds + 1):
            for name in order[round_ % len(order) :] + order[: round_ % len(order)]:
                model, optimizer = models[name]
                comm.Barrier()
                if name in tracers:
                    tracers[name].enabled = round_ > 0
                began, cpu = time.perf_counter(), time.process_time()
                for _ in range(args.steps):
                    step(model, optimizer)
                if isinstance(model, sharded.Sharded):
                    model.synchronize()
                cpu = time.process_time() - cpu
                comm.Barrier()
                if round_ > 0:  # round 0 warms up
                    seconds[name].append(comm.allreduce(time.perf_counter() - began, op=MPI.MAX) / args.steps)
                    cpu_seconds[name].append(comm.allreduce(cpu) / size / args.steps)

        def paired(name: str, over: str = "DDP") -> float:
            """Median over rounds of name's time over `over`'s in the same round (load drifts between rounds)."""
            return statistics.median(a / b for a, b in zip(seconds[name], seconds[over]))

        median = {k: statistics.median(v) for k, v in seconds.items()}
        best = {k: min(v) for k, v in seconds.items()}
        say(
            f"\n3. time per step (float32, MPI collectives), median of {args.rounds} rounds of {args.steps} steps "
            "(fastest round), over DDP's: ratio of medians, median of same-round ratios"
        )
        for name in models:
            say(
                f"  {name:>30}: {1e3 * median[name]:7.1f} ms ({1e3 * best[name]:.1f}) = {median[name] / median['DDP']:.2f} "
                f"({best[name] / best['DDP']:.2f}), same-round {paired(name):.2f}"
            )
        for name, problem in problems.items():
            say(f"  {name:>30}: does not run here: {problem}")
        for name in ("ZeRO-3 prefetch 1", "ZeRO-3 prefetch 2"):
            say(
                f"  {name} over without: {median[name] / median['ZeRO-3']:.2f}, same-round {paired(name, 'ZeRO-3'):.2f}"
            )
        steps = args.rounds * args.steps
        say(
            "  per step, mean over ranks, ms: waits for allgathers, for reduce-scatters (trace spans); "
            "CPU time of a rank (median over rounds)"
        )
        for name in models:
            waits = tracers[name].totals() if name in tracers else {}
            mean = [
                comm.allreduce(waits.get(what, 0.0)) / size / steps
                for what in ("allgather wait", "reduce-scatter wait")
            ]
            shown = f"{1e3 * mean[0]:6.1f}, {1e3 * mean[1]:6.1f}" if name in tracers else "     -,      -"
            say(f"  {name:>30}: {shown}; CPU {1e3 * statistics.median(cpu_seconds[name]):6.1f}")
        held = {name: comm.allreduce(sharded.held_bytes(*pair), op=MPI.MAX) for name, pair in models.items()}
        say(
            "  model state per rank after a step, float32 (held_bytes: parameters, gradients, optimizer state; "
            "the largest rank's), over DDP's: " + ", ".join(f"{name} {held[name] / held['DDP']:.3f}" for name in models)
        )
        for model, _ in models.values():
            close(model)
        dp.close_gloo()

    # 4. Largest model under a budget ------------------------------------------------------------------
    if 4 in args.sections:
        budget = int(args.budget * 2**20)

        def fits(stage: int, layers: int) -> bool:
            ledger = Ledger(budget)
            model = None
            try:
                model, optimizer = build(stage, comm, ledger, layers=layers, width=args.search_width, mixed=stage > 0)
                for _ in range(2):
                    step(model, optimizer, ledger)
                ok = True
            except OutOfMemory:
                ok = False
            if model is not None:
                close(model)
            return bool(comm.allreduce(int(ok), op=MPI.MIN))

        largest = {}
        for stage in range(4):
            low, high = 0, 1  # fits(low) (0: nothing checked yet); grow high until it does not fit
            while fits(stage, high):
                low, high = high, high * 2
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (middle, high) if fits(stage, middle) else (low, middle)
            largest[stage] = count_parameters(mlp(low, args.search_width)) if low else 0
        say(
            f"\n4. largest model trained under {args.budget:.0f} MiB per rank (ledger: model state, activations, "
            f"gathered units), hidden layers of {args.search_width}"
        )
        say(
            "  "
            + ", ".join(
                f"{names[s]} {largest[s] / 1e6:.2f}M = {largest[s] / max(largest[0], 1):.2f}x" for s in range(4)
            )
        )

    if 5 in args.sections:
        hybrid_bytes(args, say)
    if 6 in args.sections:
        accumulation(args, say)


def hybrid_bytes(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    """Section 5: HSDP's bytes across groups over full sharding's, for every group size, beside the formula."""
    import torch
    from ddlab import data_parallel as dp
    from ddlab import sharded
    from ddlab.models.mlp import make_mlp
    from ddlab.runtime.counting import CountingComm
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    x, y = batch(comm)
    sizes = [g for g in range(1, size) if size % g == 0]  # G = P is full sharding itself
    say(
        "\n5. hybrid sharding (stage 3 in groups of G, replicated across R = P/G): bytes sent between groups "
        "per step, all ranks (counted, float32), over full sharding's (stage 3 on all P ranks)"
    )
    if not sizes:
        say("  one rank: no groups")
        return
    for kind in ("mpi", "ring"):
        for g in sizes:
            crossing = {}
            for hybrid in (False, True):
                counting = CountingComm(comm, timeout=600, allow=("Allgatherv", "Reduce_scatter"))
                module = make_mlp(seed=1, hidden=(args.width,) * args.layers)
                model = (
                    sharded.HybridSharded(module, counting, g, stage=3, collectives=kind)
                    if hybrid
                    else sharded.Sharded(module, counting, stage=3, collectives=kind)
                )
                optimizer = model.attach(torch.optim.Adam(model.shards(), lr=1e-4))
                for _ in range(2):  # the second step is measured
                    start = len(counting.traffic.events)
                    optimizer.zero_grad()
                    dp.squared_error(model(x), y).mean().backward()
                    optimizer.step()
                step_events = counting.traffic.events[start:]
                mine = sum(e.nbytes for e in step_events if e.kind == "send" and e.peer // g != comm.Get_rank() // g)
                crossing[hybrid] = comm.allreduce(mine)
                model.close()
                counting.free()
            formula = 2 / (3 * g) if kind == "mpi" else 2 * (size - g) / (3 * (size - 1))
            shown = "2/(3G)" if kind == "mpi" else "2(P-G)/(3(P-1))"
            say(
                f"  {kind:>4}, G = {g} (R = {size // g}): HSDP {crossing[True] / 2**20:.2f} MiB, full sharding "
                f"{crossing[False] / 2**20:.2f} MiB across groups: measured {crossing[True] / crossing[False]:.3f}, "
                f"formula {shown} = {formula:.3f}; model state per rank 1/{g} of the model's, not 1/{size}"
            )


def accumulation(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    """Section 6: reduce-scatter every micro-batch or accumulate locally (no_sync): memory against bytes."""
    import contextlib

    import torch
    from ddlab import data_parallel as dp
    from ddlab import sharded
    from ddlab.models.mlp import count_parameters, make_mlp
    from ddlab.runtime.counting import CountingComm
    from ddlab.runtime.memory import Ledger
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    x, y = batch(comm)
    micro = max(1, args.micro)
    psi = count_parameters(make_mlp(seed=1, hidden=(args.width,) * args.layers))
    say(
        f"\n6. gradient accumulation over {micro} micro-batches of {BATCH // micro}: reduce-scatter every "
        "micro-batch vs no_sync (full gradient kept locally, one reduce-scatter); per rank, gradient bytes "
        "kept between micro-batches (ledger), and bytes sent per step by all ranks (counted, float32)"
    )
    for stage in (2, 3):
        held, sent = {}, {}
        for accumulate in (False, True):
            counting = CountingComm(comm, timeout=600, allow=("Allgatherv", "Reduce_scatter"))
            ledger = Ledger()
            module = make_mlp(seed=1, hidden=(args.width,) * args.layers)
            model = sharded.Sharded(module, counting, stage=stage, collectives="mpi", ledger=ledger)
            optimizer = model.attach(torch.optim.Adam(model.shards(), lr=1e-4))
            for _ in range(2):  # the second step is measured
                model.synchronize()
                before = counting.traffic.bytes_sent
                optimizer.zero_grad()
                for m in range(micro):
                    part = slice(m * BATCH // micro, (m + 1) * BATCH // micro)
                    quiet = model.no_sync() if accumulate and m < micro - 1 else contextlib.nullcontext()
                    with quiet:
                        (dp.squared_error(model(x[part]), y[part]).mean() / micro).backward()
                    if m == 0:
                        held[accumulate] = ledger.used["gradients"]
                optimizer.step()
                model.synchronize()
            sent[accumulate] = comm.allreduce(counting.traffic.bytes_sent - before)
            model.close()
            counting.free()
        say(
            f"  ZeRO-{stage}: kept {held[False] / psi:.2f} B/param every micro-batch, {held[True] / psi:.2f} "
            f"accumulating ({held[True] / max(held[False], 1):.1f}x); sent {sent[False] / 2**20:.1f} MiB "
            f"vs {sent[True] / 2**20:.1f} MiB ({sent[False] / sent[True]:.2f}x; "
            f"formula {'(M+1)/2' if stage == 2 else '3M/(2M+1)'} = "
            f"{(micro + 1) / 2 if stage == 2 else 3 * micro / (2 * micro + 1):.2f})"
        )


def batch(comm: Any) -> tuple[Any, Any]:
    """This rank's batch of BATCH samples, as in `child`."""
    from ddlab.data import StressStrainCurves

    data = StressStrainCurves(n=BATCH * comm.Get_size() * 4)
    rank = comm.Get_rank()
    return data[list(range(rank * BATCH, (rank + 1) * BATCH))]


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4])
    parser.add_argument("--sections", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6], help="which measurements (1-6)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget", type=float, default=32.0, help="MiB per rank for the largest-model search")
    parser.add_argument("--search-width", type=int, default=512, help="hidden width for the largest-model search")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step in section 6")
    return bench_main(parser, child, TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
