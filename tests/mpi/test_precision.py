"""ddlab.precision under mpiexec (lab 18's references): float16 data parallelism with loss scaling equals one
process step for step (the same steps skipped); the float8 all-gather sends half of bfloat16's bytes, counted;
the bfloat16 mixed sharded optimizer equals one process's bfloat16 mixed run; a rounded ring reduction
stays within its bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab import precision
from ddlab.allreduce import allgather_ring
from ddlab.runtime.counting import CountingComm, gather_traffic
from mpi4py import MPI
from torch import nn

STEPS = 12
GLOBAL_BATCH = 12  # splits over 4, 3, 2 and 1 ranks


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batches(seed: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(GLOBAL_BATCH, 6, generator=generator), torch.randn(GLOBAL_BATCH, 3, generator=generator))
        for _ in range(steps)
    ]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def test_float16_with_loss_scaling_equals_one_process_with_the_same_steps_skipped(comm):
    size = comm.Get_size()
    # 2^20 overflows float16 (65504) at once: the run backs off, steps, grows after 2 clean steps, overflows again
    start = precision.LossScale(scale=2.0**20, interval=2)
    model, alone = mlp(1), mlp(1)
    taken, state = precision.train_float16(comm, model, batches(2), mse, 0.05, start)
    want, want_state = precision.train_float16_one_process(alone, batches(2), mse, 0.05, start, blocks=size)
    assert taken == want, f"steps taken on {size} ranks {taken}, on one process {want}"
    assert state == want_state
    assert 0 < state.skipped < STEPS and sum(taken) == STEPS - state.skipped
    assert state.scale < start.scale and any(not t for t in taken[-6:]), "the scale never grew into an overflow again"
    for p, q in zip(model.parameters(), alone.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    everyone = comm.allgather([p.detach().clone() for p in model.parameters()])
    for other in everyone[1:]:
        for p, q in zip(everyone[0], other):
            assert torch.equal(p, q), "the ranks' parameters parted"


def test_a_scaler_sees_another_ranks_overflow(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    grads = [torch.ones(3) * (float("inf") if rank == size - 1 else 1.0)]
    unscaled, state = precision.loss_scale_step(comm, grads, precision.LossScale(scale=8.0))
    assert unscaled is None and state.scale == 4.0 and state.skipped == 1


def counted_bytes(comm: MPI.Comm, fn, *args) -> tuple[np.ndarray, int]:
    counting = CountingComm(comm, timeout=30.0)
    try:
        result = fn(counting, *args)
    finally:
        traffic = gather_traffic(counting)
        counting.free()
    return result, sum(t.bytes_sent for t in traffic)


@pytest.mark.parametrize("dtype", precision.FORMATS)
def test_float8_allgather_sends_half_of_bfloat16s_bytes_and_equals_a_local_cast(comm, dtype):
    rank, size = comm.Get_rank(), comm.Get_size()
    shard = 1000
    bounds = [r * shard for r in range(size + 1)]
    full = torch.randn(bounds[-1], generator=torch.Generator().manual_seed(5)) * torch.linspace(0.01, 100, bounds[-1])
    mine = full[bounds[rank] : bounds[rank + 1]].numpy().copy()
    before = mine.copy()
    got, f8 = counted_bytes(comm, precision.float8_allgather, mine, bounds, dtype, allgather_ring)
    _, bf16 = counted_bytes(comm, precision.bfloat16_allgather, mine, bounds, allgather_ring)
    _, f32 = counted_bytes(comm, allgather_ring, mine, bounds)
    scales_bytes = 4 * size * (size - 1)  # each rank's float32 scale to every other rank
    assert f8 == bf16 // 2 + scales_bytes and bf16 == f32 // 2
    for r in range(size):
        piece = full[bounds[r] : bounds[r + 1]].view(1, -1)
        q, scale = precision.quantize_float8(piece, dtype, (1, shard))
        assert np.array_equal(
            got[bounds[r] : bounds[r + 1]], precision.dequantize(q, scale, (1, shard)).view(-1).numpy()
        )
    assert np.array_equal(mine, before)


def test_bfloat16_mixed_sharded_optimizer_equals_one_process(comm):
    size = comm.Get_size()
    model, alone = mlp(3).to(torch.bfloat16), mlp(3).to(torch.bfloat16)
    data = batches(4, steps=5)
    precision.train_mixed(comm, model, data, mse, blocks=GLOBAL_BATCH, lr=1e-2)
    precision.train_mixed(MPI.COMM_SELF, alone, data, mse, blocks=GLOBAL_BATCH, lr=1e-2)
    for p, q in zip(model.parameters(), alone.parameters()):
        assert p.dtype == torch.bfloat16
        # float32 sums in another order may move a master across one bfloat16 rounding boundary, no more
        ulp = q.detach().float().abs() * 2.0**-7 + 1e-30
        assert bool(((p.detach().float() - q.detach().float()).abs() <= ulp).all()), (size, p, q)
    assert not torch.equal(model[0].weight, mlp(3).to(torch.bfloat16)[0].weight), "training left the weights alone"


def test_mixed_bytes_per_parameter_are_zeros_2_2_12_over_p(comm):
    size = comm.Get_size()
    model = mlp(3).to(torch.bfloat16)
    optimizer = precision.MixedShardedOptimizer(model.parameters(), torch.optim.Adam, comm, lr=1e-2)
    mse(model(torch.randn(4, 6).to(torch.bfloat16)), torch.zeros(4, 3, dtype=torch.bfloat16)).backward()
    optimizer.step()
    n = sum(p.numel() for p in model.parameters())
    held = optimizer.held_bytes()
    want = precision.predicted_bytes_per_parameter("bfloat16", size)
    assert held["parameters"] == 2 * n and held["gradients"] == 2 * n
    assert (
        held["optimizer"] == 12 * optimizer.space.shard_numel
        and abs(held["optimizer"] / n - want["optimizer"]) < 12 * size / n
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rounded_reduce_scatter_stays_within_its_bound(comm, dtype):
    rank, size = comm.Get_rank(), comm.Get_size()
    bounds = [r * 500 for r in range(size + 1)]
    x = np.random.default_rng([7, rank]).uniform(0.5, 1.5, bounds[-1]).astype(np.float32)
    before = x.copy()
    error, gamma = precision.relative_error(comm, x, bounds, dtype)
    assert np.array_equal(x, before)
    assert error <= gamma
    if dtype == torch.bfloat16 and size > 1:
        assert error > 2.0**-24 * size, "a bfloat16 reduction that loses nothing did not round"
    got = precision.reduce_scatter_rounded(comm, x, bounds, dtype)
    assert np.array_equal(got, torch.from_numpy(got).to(dtype).float().numpy()), "a result not representable in dtype"
