"""ddlab.sharded beyond ZeRO: hybrid sharding (HSDP) and gradient accumulation, on several ranks.

Both must reach one process's parameters on the global batch (float64), and their bytes
are counted with the counting communicator and compared with the formulas the library states.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch
from ddlab import sharded
from ddlab.data import StressStrainCurves
from ddlab.data_parallel import squared_error
from ddlab.models import make_mlp
from ddlab.runtime.counting import CountingComm, gather_traffic
from ddlab.runtime.memory import Ledger
from mpi4py import MPI

TOLERANCE = 1e-10
PER_RANK = 6
STEPS = 3
HIDDEN = (48, 32, 17)  # 17: units whose length no group size here divides


def batches(size: int, rank: int | None, micro: int = 1):
    """This rank's block of each global batch of size * PER_RANK * micro samples (rank=None: all of it),
    as `micro` micro-batches."""
    data = StressStrainCurves(n=size * PER_RANK * micro * STEPS, seed=3, dtype=torch.float64)
    for step in range(STEPS):
        first = step * size * PER_RANK * micro
        blocks = []
        for m in range(micro):
            start = first + m * size * PER_RANK
            idx = (
                np.arange(start, start + size * PER_RANK)
                if rank is None
                else np.arange(start + rank * PER_RANK, start + (rank + 1) * PER_RANK)
            )
            blocks.append(data[idx])
        yield blocks


def adam(params):
    return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3)


def one_process(size: int, micro: int = 1) -> dict[str, torch.Tensor]:
    model = make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN)
    optimizer = adam(model.parameters())
    for blocks in batches(size, None, micro):
        optimizer.zero_grad()
        for x, y in blocks:
            (squared_error(model(x), y).mean() / micro).backward()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def train(model: sharded.Sharded, comm, micro: int = 1, accumulate: bool = False) -> torch.optim.Optimizer:
    """Steps on this rank's micro-batches; `accumulate`: keep the full gradient until the last one."""
    optimizer = model.attach(adam(model.shards()))
    for blocks in batches(comm.Get_size(), comm.Get_rank(), micro):
        optimizer.zero_grad()
        for m, (x, y) in enumerate(blocks):
            if accumulate and m < micro - 1:
                with model.no_sync():
                    (squared_error(model(x), y).mean() / micro).backward()
            else:
                (squared_error(model(x), y).mean() / micro).backward()
        optimizer.step()
    return optimizer


def relative(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(float((params[k] - v).abs().max() / v.abs().max()) for k, v in reference.items())


def group_sizes(size: int) -> list[int]:
    return [g for g in range(1, size + 1) if size % g == 0]


@pytest.mark.parametrize(("stage", "collectives"), [(1, "mpi"), (2, "ring"), (3, "mpi"), (3, "ring")])
def test_hybrid_sharding_matches_one_process_for_every_group_size(comm, stage, collectives):
    reference = one_process(comm.Get_size())
    worst, shapes = 0.0, []
    for g in group_sizes(comm.Get_size()):
        model = sharded.HybridSharded(
            make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN), comm, g, stage=stage, collectives=collectives
        )
        train(model, comm)
        worst = max(worst, relative(model.full_parameters(), reference))
        shapes.append([(u.master.numel(), -(-u.space.numel // g)) for u in model.units])
        model.close()
    assert comm.allreduce(worst, op=MPI.MAX) < TOLERANCE
    assert all(mine == whole for unit in shapes for mine, whole in unit)  # 1/G of each unit: G-way, not P-way


def test_hybrid_replicas_hold_the_same_shards(comm):
    g = 2 if comm.Get_size() % 2 == 0 else 1
    model = sharded.HybridSharded(make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN), comm, g, stage=3)
    train(model, comm)
    mine = np.concatenate([u.master.detach().numpy() for u in model.units])
    replicas = model.replicate_comm.allgather(mine)
    model.close()
    assert all(np.array_equal(r, replicas[0]) for r in replicas)


@pytest.mark.parametrize("group_size", [0, 5, 1.5, "2"])
def test_a_group_size_that_does_not_divide_the_ranks_is_refused(comm, group_size):
    if group_size == 5 and comm.Get_size() % 5 == 0:
        pytest.skip("5 divides this rank count")
    with pytest.raises(ValueError, match="group_size must divide the .* ranks"):
        sharded.HybridSharded(make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN), comm, group_size)


def crossing(traffic: list, group_size: int) -> int:
    """Bytes sent from one group to another, all ranks."""
    return sum(e.nbytes for t in traffic for e in t.sends if e.peer // group_size != t.rank // group_size)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("collectives", ["mpi", "ring"])
def test_bytes_crossing_groups_follow_the_formula(comm, stage, collectives):
    size = comm.Get_size()
    per_step = {}
    for g in group_sizes(size):
        for kind in ("full", "hybrid"):
            counting = CountingComm(comm, timeout=60, allow=("Allgatherv", "Reduce_scatter"))
            module = make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN)
            options = {"stage": stage, "collectives": collectives}
            model = (
                sharded.HybridSharded(module, counting, g, **options)
                if kind == "hybrid"
                else sharded.Sharded(module, counting, **options)
            )
            train(model, comm)
            model.synchronize()
            padded = [u.space.padded for u in model.units]
            model.close()
            per_step[g, kind] = crossing(gather_traffic(counting), g), padded
            counting.free()
    c, b = (3 if stage == 3 else 2), 8
    for g in group_sizes(size):
        r = size // g
        sent, padded_g = per_step[g, "hybrid"]
        assert sent == STEPS * 2 * (r - 1) * sum(padded_g) * b  # 2 N b per step
        sent, padded_p = per_step[g, "full"]
        if collectives == "mpi":  # each rank's chunks straight to their owners: (P-G) of P-1 peers outside
            assert sent == STEPS * c * (size - g) * sum(padded_p) * b
        else:  # the ring over P ranks: R of its P links leave a group (none if R = 1)
            assert sent == STEPS * c * (r if r > 1 else 0) * (size - 1) * sum(padded_p) // size * b


ACCUMULATION = [{"stage": 1}, {"stage": 2}, {"stage": 3}, {"stage": 3, "prefetch": 1, "collectives": "ring"}]


@pytest.mark.parametrize("options", ACCUMULATION, ids=str)
@pytest.mark.parametrize("accumulate", [False, True], ids=["reduce every micro-batch", "accumulate locally"])
def test_gradient_accumulation_matches_one_process(comm, options, accumulate):
    model = sharded.Sharded(make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN), comm, **options)
    train(model, comm, micro=3, accumulate=accumulate)
    error = relative(model.full_parameters(), one_process(comm.Get_size(), micro=3))
    freed = options["stage"] < 3 or all(u.full.untyped_storage().nbytes() == 0 for u in model.units)
    model.close()
    assert comm.allreduce(error, op=MPI.MAX) < TOLERANCE
    assert comm.allreduce(int(freed), op=MPI.MIN) == 1  # stage 3 frees its units inside no_sync too


@pytest.mark.parametrize("stage", [2, 3])
def test_accumulation_trades_gradient_memory_for_bytes(comm, stage):
    """Reduce-scattering every micro-batch sends M reduce-scatters per step and keeps no full gradient
    between micro-batches; accumulating locally keeps every parameter's gradient and sends one."""
    micro, size, b = 3, comm.Get_size(), 8
    sent, held = {}, {}
    for accumulate in (False, True):
        counting = CountingComm(comm, timeout=60, allow=("Allgatherv", "Reduce_scatter"))
        ledger = Ledger()
        model = sharded.Sharded(
            make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN), counting, stage=stage, ledger=ledger
        )
        optimizer = model.attach(adam(model.shards()))
        for blocks in batches(size, comm.Get_rank(), micro):
            optimizer.zero_grad()
            for m, (x, y) in enumerate(blocks):
                with model.no_sync() if accumulate and m < micro - 1 else contextlib.nullcontext():
                    (squared_error(model(x), y).mean() / micro).backward()
                if m == 0:  # what the next micro-batch's forward runs beside
                    held[accumulate] = ledger.used["gradients"]
            optimizer.step()
        model.synchronize()
        padded = sum(u.space.padded for u in model.units)
        numel = sum(u.space.numel for u in model.units)
        model.close()
        sent[accumulate] = sum(t.bytes_sent for t in gather_traffic(counting))
        counting.free()
    gathers = 1 if stage == 2 else 2 * micro  # allgathers per step: after the step, or twice per micro-batch
    assert sent[False] == STEPS * (micro + gathers) * (size - 1) * padded * b
    assert sent[True] == STEPS * (1 + gathers) * (size - 1) * padded * b
    assert held[True] - held[False] == numel * b  # the full gradient, kept between micro-batches


def test_a_hybrid_checkpoint_is_written_once_and_loads_on_other_rank_counts(comm, tmp_path_factory):
    path = comm.bcast(str(tmp_path_factory.mktemp("hybrid")) if comm.Get_rank() == 0 else None)
    g = 2 if comm.Get_size() % 2 == 0 else 1
    model = sharded.HybridSharded(make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN), comm, g, stage=3)
    optimizer = train(model, comm)
    expected = model.full_parameters()
    sharded.save_sharded(path, model, optimizer, step=STEPS)
    model.close()
    files = sorted(p.name for p in Path(path).glob("shard-*.pt"))  # every rank returns after the commit
    other = sharded.Sharded(make_mlp(seed=5, dtype=torch.float64, hidden=HIDDEN), comm, stage=2)
    state = sharded.load_sharded(path, other, other.attach(adam(other.shards())))
    got = other.full_parameters()
    other.close()
    assert files == [f"shard-{q:05d}.pt" for q in range(g)] and state == {"step": STEPS}
    assert all(torch.equal(got[k], v) for k, v in expected.items())
