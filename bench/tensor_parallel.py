"""Lab 14's figures: what tensor and sequence parallelism divide, what they send, what a step costs.

One MPI job of 4 ranks, lab 14's GPT at bench size (4 blocks, width 128, 8 heads, sequence
64, vocabulary 256, a global batch of 8 sequences). It prints, side by side:

- parameter bytes per rank over one process's: the split parameters (goal exactly 1/t) and
  the replicated ones named (position embedding, LayerNorms, row-parallel biases);
- activation bytes one block keeps for backward, per rank, measured with lab 06's `Ledger`
  (saved-tensor hooks) in float16 with dropout on, against Korthikanti et al.'s
  sbh(34 + 5as/h) (one process), sbh(10 + 24/t + 5as/(ht)) (tensor parallel) and
  sbh(34/t + 5as/(ht)) (tensor + sequence parallel), and the ratio of the last two measured;
- bytes each rank sends in one training step (float32), counted by the counting communicator,
  against `bytes_sent_per_step` (4 allreduces of s·b·h per block, or their halves);
- time per training step (float32, dropout off, AdamW) of tensor parallel (t=4) three ways -- the library's
  TensorParallelGPT, the library's module surgery `parallelize` and the solution notebook's own exercises
  14.1-14.3 (`my_parallelize` with its layers, run from solutions/) --, tensor + sequence parallel two ways
  (TensorParallelGPT, and the solution's `my_parallelize` run by its exercise 14.5 `my_sequence_parallel_block`
  through `parallelize_gpt`), data parallel (d=4, lab 04's averaging over lab 03's ring), data x tensor
  (2 x 2) and PyTorch's own tensor parallelism (`parallelize_module` with ColwiseParallel /
  RowwiseParallel over a gloo DeviceMesh, embeddings replicated) over one process's (rank 0
  alone, the whole batch). The variants take turns in every round (load from other programs
  hits them alike); median and fastest round are shown.

    .venv/bin/python bench/tensor_parallel.py [--rounds 5] [--steps 5]

It relaunches itself under mpiexec (`ddlab.runtime.mpi.bench_main`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable

TIMEOUT = 3600
BATCH = 8


def _config(dropout: float):
    from ddlab.models.gpt import GPTConfig

    return GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=8, n_embd=128, dropout=dropout)


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def parameters(comm) -> list[str]:
    from ddlab.models.gpt import make_gpt
    from ddlab.tensor_parallel import TensorParallelGPT

    model = make_gpt(_config(0.1))
    split = TensorParallelGPT(model, comm)
    replicated = _nbytes(split.replicated_parameters())
    whole = _nbytes(model.parameters())
    mine = _nbytes(split.parameters()) - replicated
    ratios = comm.gather(mine / (whole - replicated), root=0)
    if ratios is None:
        return []
    names = sorted(
        {
            name.split(".")[-2] if name.startswith("blocks") else name.split(".")[0]
            for name, p in split.named_parameters()
            if any(p is q for q in split.replicated_parameters())
        }
    )
    return [
        f"parameter bytes per rank over one process's, split parameters ({(whole - replicated) / 2**10:.0f} KiB "
        f"in one process): " + ", ".join(f"{r:.4f}" for r in ratios) + f" (1/t = {1 / comm.Get_size():.4f})",
        f"replicated on every rank: {replicated / 2**10:.1f} KiB, {replicated / whole:.1%} of one process's "
        f"parameters ({', '.join(names)}); per rank in all: {(mine + replicated) / whole:.4f} of one process's",
    ]


def _block_activations(block, x, seed: int, length: int | None) -> int:
    from ddlab.runtime.memory import Ledger

    ledger = Ledger()
    ledger.ignore(block)
    with ledger.activations():
        out = block(x, seed) if length is None else block(x, seed, length)
    kept = ledger.used["activations"]
    del out
    return kept


def activations(comm) -> list[str]:
    import torch
    from ddlab.models.gpt import make_gpt
    from ddlab.runtime.blocks import block_range
    from ddlab.tensor_parallel import ParallelBlock, activation_bytes_per_layer

    config = _config(0.1)
    t, s, b, h, a = comm.Get_size(), config.block_size, BATCH, config.n_embd, config.n_head
    model = make_gpt(config, dtype=torch.float16)
    block = model.blocks[1]
    x = torch.randn(b, s, h, dtype=torch.float16, generator=torch.Generator().manual_seed(0))
    rows = block_range(s, comm.Get_rank(), t)
    one = _block_activations(block, x.clone().requires_grad_(), 3, None)
    tensor = _block_activations(ParallelBlock(block, comm), x.clone().requires_grad_(), 3, None)
    sequence = _block_activations(
        ParallelBlock(block, comm, sequence_parallel=True), x[:, rows.start : rows.stop].clone().requires_grad_(), 3, s
    )
    measured = comm.gather((tensor, sequence), root=0)
    if measured is None:
        return []
    want = {
        name: activation_bytes_per_layer(s, b, h, a, tp, sp)
        for name, tp, sp in (("one", 1, False), ("tensor", t, False), ("sequence", t, True))
    }
    lines = [
        f"activation bytes one block keeps (s={s}, b={b}, h={h}, a={a}, float16, dropout 0.1), measured / formula:",
        f"  one process            {one / 2**10:8.1f} KiB / {want['one'] / 2**10:8.1f} KiB = "
        f"{one / want['one']:.3f}   sbh(34 + 5as/h)",
    ]
    for i, (name, formula) in enumerate(
        (("tensor", "sbh(10 + 24/t + 5as/(ht))"), ("sequence", "sbh(34/t + 5as/(ht))"))
    ):
        per_rank = [m[i] for m in measured]
        lines.append(
            f"  {'tensor parallel' if name == 'tensor' else 'tensor + sequence':22} "
            + ", ".join(f"{m / 2**10:.1f}" for m in per_rank)
            + f" KiB per rank / "
            f"{want[name] / 2**10:.1f} KiB = " + ", ".join(f"{m / want[name]:.3f}" for m in per_rank) + f"   {formula}"
        )
    tp, sp = (max(m[i] for m in measured) for i in (0, 1))
    lines.append(
        f"  sequence parallel over tensor parallel alone: measured {sp / tp:.3f}, formula "
        f"{want['sequence'] / want['tensor']:.3f}; per rank over one process: tensor {tp / one:.3f}, "
        f"tensor + sequence {sp / one:.3f}"
    )
    return lines


def traffic(comm) -> list[str]:
    from ddlab.data.text import BatchSampler, make_corpus
    from ddlab.models.gpt import make_gpt
    from ddlab.runtime.counting import CountingComm, gather_traffic
    from ddlab.tensor_parallel import TensorParallelGPT, bytes_sent_per_step, reduce_sequence_parallel_grads

    config = _config(0.1)
    x, y = BatchSampler(make_corpus().train, BATCH, config.block_size, seed=1).batch_at(0)
    lines = ["bytes each rank sends in one training step (float32), counted / formula:"]
    for sp in (False, True):
        counting = CountingComm(comm, timeout=120.0)
        split = TensorParallelGPT(make_gpt(config), counting, sequence_parallel=sp)
        _, loss = split(x, y, seed=0)
        assert loss is not None
        loss.backward()
        reduce_sequence_parallel_grads(split)
        sent = [t.bytes_sent for t in gather_traffic(counting)]
        counting.free()
        replicated = sum(p.numel() for p in split.replicated_parameters())
        want = bytes_sent_per_step(
            config.block_size, BATCH, config.n_embd, config.n_layer, comm.Get_size(), sp, 4, replicated
        )
        parts = ", ".join(f"{k} {v / 2**10:.1f} KiB" for k, v in want.items() if k != "total" and v)
        lines.append(
            f"  {'tensor + sequence' if sp else 'tensor parallel':18} "
            + ", ".join(f"{s / 2**10:.1f}" for s in sent)
            + f" KiB per rank / {want['total'] / 2**10:.1f} "
            f"KiB ({parts}): {'equal' if all(s == want['total'] for s in sent) else 'DIFFERENT'}"
        )
    return lines


def _variants(comm) -> dict[str, tuple[Callable[[int], None], bool]]:
    import torch
    from ddlab.data.text import BatchSampler, make_corpus
    from ddlab.data_parallel import average_gradients
    from ddlab.models.gpt import make_gpt
    from ddlab.tensor_parallel import TensorParallelGPT, make_data_tensor_grid, parallelize_gpt, train_step
    from ddlab.tensor_parallel.timing import torch_parallelize

    config = _config(0.0)
    sampler = BatchSampler(make_corpus().train, BATCH, config.block_size, seed=1)
    batches = [sampler.batch_at(i) for i in range(4)]
    rank, size = comm.Get_rank(), comm.Get_size()
    variants: dict[str, tuple[Callable[[int], None], bool]] = {}

    def plain(model, samples: slice, data=None) -> Callable[[int], None]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

        def step(i: int) -> None:
            x, y = batches[i % len(batches)]
            _, loss = model(x[samples], y[samples])
            optimizer.zero_grad()
            loss.backward()
            if data is not None:
                average_gradients(model, data, allreduce="ring")
            optimizer.step()

        return step

    def split(model, comm_, data=None, sp=False) -> Callable[[int], None]:
        tp = TensorParallelGPT(model, comm_, sequence_parallel=sp)
        optimizer = torch.optim.AdamW(tp.parameters(), lr=1e-3, foreach=False)

        def step(i: int) -> None:
            x, y = batches[i % len(batches)]
            train_step(tp, optimizer, x, y, data)

        return step

    variants["one process"] = (plain(make_gpt(config), slice(None)), rank == 0)
    variants["tensor, library TensorParallelGPT (t=4)"] = (split(make_gpt(config), comm), True)
    variants["tensor, library parallelize (t=4)"] = (plain(parallelize_gpt(make_gpt(config), comm), slice(None)), True)
    mine, plan, block = _student_parallelize()
    variants["tensor, solution's my_parallelize (t=4)"] = (
        plain(parallelize_gpt(make_gpt(config), comm, plan, mine), slice(None)),
        True,
    )
    variants["tensor + sequence"] = (split(make_gpt(config), comm, sp=True), True)
    variants["tensor + sequence, solution's"] = (
        plain(parallelize_gpt(make_gpt(config), comm, plan, mine, sequence_parallel=block), slice(None)),
        True,
    )
    share = BATCH // size
    variants["data (d=4)"] = (plain(make_gpt(config), slice(rank * share, (rank + 1) * share), comm), True)
    grid = make_data_tensor_grid(comm, 2)
    variants["data x tensor (2x2)"] = (split(make_gpt(config), grid.tensor, grid.data), True)
    try:
        variants["torch parallelize_module (t=4)"] = (
            plain(torch_parallelize(make_gpt(config), comm), slice(None)),
            True,
        )
    except Exception as err:  # report why PyTorch's own tensor parallelism does not run here
        if rank == 0:
            print(f"PyTorch's parallelize_module did not run: {type(err).__name__}: {err}")
    return variants


def _student_parallelize():
    """The solution's own exercises 14.1-14.3 and 14.5 (MyCopy, MyReduce, the two layers, my_parallelize; the
    sequence-parallel block), run from solutions/14_tensor_parallel.ipynb: the path a student's code takes."""
    from pathlib import Path

    from ddlab.tools.solutions import exercises, run_cells

    notebook = Path(__file__).resolve().parent.parent / "solutions/14_tensor_parallel.ipynb"
    namespace = run_cells(notebook, exercises("14.1", "14.2", "14.3", "14.5", setup="%%px\nimport torch"))
    return namespace["my_parallelize"], namespace["PLAN"], namespace["my_sequence_parallel_block"]


def timing(comm, rounds: int, steps: int) -> list[str]:
    from ddlab.tensor_parallel.timing import step_seconds

    variants = _variants(comm)
    names = list(variants)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, active = variants[name]
            seconds[name].append(step_seconds(comm, step, steps, active))
    base_median = statistics.median(seconds["one process"])
    base_fast = min(seconds["one process"])
    lines = [
        f"time per training step (float32, dropout off, AdamW, global batch {BATCH}; {rounds} rounds of "
        f"{steps} steps), ms median / fastest round, and over one process's:"
    ]
    for name in names:
        med, fast = statistics.median(seconds[name]), min(seconds[name])
        lines.append(
            f"  {name:32} {med * 1e3:7.1f} / {fast * 1e3:7.1f}   {med / base_median:5.2f} / {fast / base_fast:5.2f}"
        )
    return lines


def child(rounds: int, steps: int) -> None:
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    lines = [f"{comm.Get_size()} ranks; GPT {_config(0.1)}; global batch {BATCH}", ""]
    lines += parameters(comm) + [""] + activations(comm) + [""] + traffic(comm) + [""]
    lines += timing(comm, rounds, steps)
    if comm.Get_rank() == 0:
        print("\n".join(lines))
    from ddlab.data_parallel import close_gloo

    close_gloo()


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    return bench_main(parser, lambda a: child(a.rounds, a.steps), TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
